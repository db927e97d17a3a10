from __future__ import annotations

from tests.rollouts._helpers import tokenizer as tokenizer
