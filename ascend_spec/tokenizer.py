"""The checkpoint's tokenizer (``tokenizer.json``, loaded with the ``tokenizers`` library)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}; a checkpoint folder needs the HF tokenizer "
                                    "file tokenizer.json beside config.json")
        self._tok = Tokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # No special tokens: vLLM's PreTrainedTokenizerFast for this checkpoint adds none either.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
