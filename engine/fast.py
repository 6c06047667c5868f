"""The model's fast forms, handed in (model.Speed): torch's fused attention kernel wherever it
gives the explicit attention's result (engine/fast_attention.py) and appends written in place
into spare room (engine/fast_cache.py). The harness loads every model with them:

    m, tok = model.load(speed=SPEED)

Each is tested equal to the naive form it replaces (tests/test_model.py, tests/test_sync.py)."""
from __future__ import annotations

from engine import fast_attention, fast_cache
from model import Speed

SPEED = Speed(facts=fast_attention.step_facts, attention=fast_attention.attention_sdpa,
              append=fast_cache.append)
