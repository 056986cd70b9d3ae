"""The checkpoint's own tokenizer (tokenizer.json, via `tokenizers`) and chat template
(jinja2, from tokenizer_config.json or chat_template.jinja), plus its EOS ids."""

import json
import os

from ..storage.errors import read_json
from .errors import ChatTemplateError, TokenizerMissing


def _token_str(v) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as {"content": ...}
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """Raises TokenizerMissing if the directory has no loadable tokenizer.json. `spec`: a
    GGUF file's tokenizer instead (storage/gguf.tokenizer_spec: a tokenizer.json's text, the
    chat template, the BOS and EOS tokens)."""

    def __init__(self, path: str, spec: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        if spec is not None:
            self.tok = HFTokenizer.from_str(spec["json"])
            self.config = {}
            self.chat_template, self.bos_token, self.eos_token = spec["chat_template"], spec["bos_token"], spec["eos_token"]
            return
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise TokenizerMissing(f"{path}: no tokenizer.json (colibri uses the checkpoint's own tokenizer)")
        try:
            self.tok = HFTokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerMissing(f"{file}: cannot be loaded ({str(e).splitlines()[0]})") from None
        cfg_file = os.path.join(path, "tokenizer_config.json")
        self.config = read_json(cfg_file) if os.path.isfile(cfg_file) else {}
        self.chat_template = self.config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                self.chat_template = f.read()
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))

    def most_bytes(self, n_tokens: int) -> int:
        """The most UTF-8 bytes of text that can come to fewer than `n_tokens` tokens: each
        token stands for at most its own string's bytes (a byte-level token's string takes
        up to twice the bytes it stands for), and a normaliser shrinks text at most 4x (NFKC:
        a full-width letter's 3 bytes become 1). A longer text is refused unread by the
        tokenizer: tokenising megabytes costs seconds and a gigabyte of RAM."""
        longest = max(len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True))
        return 4 * n_tokens * longest

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of text; `special` adds what the tokenizer's post-processor adds (e.g. BOS)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render messages with the checkpoint's chat_template, generation prompt added, the way
        transformers does (sandboxed jinja2, trim_blocks, lstrip_blocks).

        Raises ChatTemplateError if there is no template or it fails to render.
        """
        if not self.chat_template or not isinstance(self.chat_template, str):
            raise ChatTemplateError("this model has no chat_template; run without --chat")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the model's chat_template failed: {e}") from None


def eos_ids(path: str, config: dict, tokenizer: Tokenizer | None = None) -> list[int]:
    """EOS token ids: generation_config.json's eos_token_id, else config.json's, else the
    tokenizer's eos_token. Each may be one id or a list."""
    gen_file = os.path.join(path, "generation_config.json")
    gen = read_json(gen_file) if os.path.isfile(gen_file) else {}
    for source in (gen, config):
        v = source.get("eos_token_id")
        if isinstance(v, int):
            return [v]
        if isinstance(v, list) and v:
            return [i for i in v if isinstance(i, int)]
    if tokenizer is not None and (i := tokenizer.token_id(tokenizer.eos_token)) is not None:
        return [i]
    return []
