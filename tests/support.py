"""Inputs several test modules share: one copy of each, so that engines built on them see the same requests."""
from __future__ import annotations

#: code-like prompts for the trained fixture (its tokenizer encodes them) and a budget per prompt: five requests
#: over four slots, unequal lengths, so that the batch drains and joins
CODE_TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
              "for i in range(10):\n", "    return"]
CODE_MAX_TOKENS = [30, 50, 20, 60, 40]
