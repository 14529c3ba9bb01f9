"""Tokenizer (HF ``tokenizer.json`` + ``tokenizer_config.json``), the chat template, and streaming
detokenisation with stop strings."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.json_words import field_value, json_type

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")


def _token_content(value: Any, where: str) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as a serialised AddedToken.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{where}: expected a token string or an AddedToken object with a 'content' string, "
        f"got {value!r}"
    )


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary (GPT-2's, DeepSeek's) stands for:
    printable Latin-1 bytes as themselves, the rest as the characters from U+0100 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(0x100 + shifted)] = b
            shifted += 1
    return out


_BYTE_OF = _byte_level_alphabet()


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (JSON allows ``"\\ud83d"``; UTF-8 cannot
    encode it, and the tokenizer raises a TypeError on it), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def validate_messages(messages: Any) -> None:
    """Raise ``ValueError`` naming the first problem: ``messages`` must be a non-empty list of
    ``{"role": "system" | "user" | "assistant", "content": str}`` dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            msg = f"messages[{i}] must be an object with 'role' and 'content', got {json_type(m)}"
            raise ValueError(msg)
        if m.get("role") not in CHAT_ROLES:
            got = field_value(m, "role")
            msg = f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {got}"
            raise ValueError(msg)
        if not isinstance(m.get("content"), str):
            got = field_value(m, "content")
            raise ValueError(f"messages[{i}].content must be a string, got {got}")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its checkpoint."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
        self._added = set(tokenizer.get_added_tokens_decoder())  # ids whose bytes are their text's
        self.bos_token = bos_token
        self.eos_token = eos_token
        # tokenizer_config.json's add_bos_token: false means a text prompt is encoded without the
        # BOS (as transformers and vLLM encode it with add_special_tokens)
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.chat_template = chat_template
        self._max_token_chars: int | None = None  # see min_tokens
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            try:
                self._template = env.from_string(chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat_template does not parse: {e}") from e

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError for a BOS or EOS past the model's vocabulary (tokenizer.json may add tokens
        past config.json's vocab_size): such a BOS refused every text prompt ("prompt token ids
        must be in [0, V)"), such an EOS failed every decode step that masks it (min_tokens')."""
        for name, token, tid in (
            ("bos_token", self.bos_token, self.bos_token_id),
            ("eos_token", self.eos_token, self.eos_token_id),
        ):
            if tid is not None and tid >= vocab_size:
                raise ValueError(
                    f"tokenizer_config.json field {name!r}: {token!r} is token id {tid}, outside "
                    f"the model's vocabulary [0, {vocab_size}) (config.json vocab_size)"
                )

    def _special_id(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        return tid

    @classmethod
    def from_dir(
        cls, path: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None
    ) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (bos/eos tokens, chat_template;
        a ``chat_template.jinja`` file next to them takes precedence, as in recent HF exports).
        ``bos_token_id`` / ``eos_token_id`` (the model config's) stand in, with a warning, for a
        token ``tokenizer_config.json`` has no entry for (or a missing file): without a BOS every
        prompt would be encoded without it, silently; an entry of null means none."""
        path = Path(path)
        tok_file, cfg_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception on bad files
            raise ValueError(f"{tok_file}: cannot load tokenizer: {e}") from e
        cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:  # (the latter named no file)
                raise ValueError(f"{cfg_file}: invalid JSON: {e}") from e
            if not isinstance(cfg, dict):  # (cfg.get below: an AttributeError)
                raise ValueError(f"{cfg_file}: expected a JSON object, not {type(cfg).__name__}")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                logger.warning(
                    "%s: chat_template lists %s but no 'default' one: none is used",
                    cfg_file, sorted(map(str, named)),
                )  # fmt: skip
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:  # (a bare codec error named no file)
                raise ValueError(f"{jinja_file}: not UTF-8 text: {e}") from e
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{cfg_file}: chat_template must be a string")
        add_bos = cfg.get("add_bos_token")
        add_bos = True if add_bos is None else add_bos  # (null: unset, as transformers reads it)
        if not isinstance(add_bos, bool):
            raise ValueError(f"{cfg_file}: add_bos_token must be a boolean, got {add_bos!r}")
        special = {}
        for name, tid in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
            special[name] = _token_content(cfg.get(name), f"{cfg_file} field {name!r}")
            if name not in cfg and tid is not None:  # (an explicit null: none, as HF reads it)
                special[name] = tok.id_to_token(tid)
                if special[name] is None:
                    raise ValueError(f"{name} id {tid} is not in the tokenizer's vocabulary")
                logger.warning(
                    "%s names no %s: using the model config's id %d (%r)",
                    cfg_file, name, tid, special[name],
                )  # fmt: skip
        try:
            return cls(tok, chat_template=template, add_bos_token=add_bos, **special)
        except ValueError as e:  # the template, a special token: named with their file
            source = jinja_file if jinja_file.is_file() else cfg_file
            raise ValueError(f"{source}: {e}") from e

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids are in ``[0, vocab_size)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it are recognised as special tokens.

        The BOS is added here (not by the tokenizer's post-processor), so ``add_bos=False`` is
        exact: use it for chat-templated text, whose template already writes ``bos_token``. A
        tokenizer whose config says ``add_bos_token: false`` adds none either way.
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        if (bad := lone_surrogate(text)) is not None:
            ch = f"U+{ord(text[bad]):04X}"
            raise ValueError(f"text to encode has a lone surrogate ({ch}) at index {bad}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` that costs no tokenising, so a server can refuse
        a prompt far over the context at once. 0 (no bound) when the tokenizer normalises text,
        since a normaliser may shrink it."""
        if self._tok.normalizer is not None:
            return 0
        if self._max_token_chars is None:
            # +1: a SentencePiece-style decoder drops the leading space a token covers.
            n = self.vocab_size
            self._max_token_chars = 1 + max(
                len(self._tok.decode([i], skip_special_tokens=False)) for i in range(n)
            )
        return len(text) // self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens such as EOS dropped by default)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def added_token_text(self, token_id: int) -> str | None:
        """The text of an added token (special or not: tokenizer.json's ``added_tokens``), None
        for any other id."""
        return self._tok.id_to_token(token_id) if token_id in self._added else None

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's own string for ``token_id`` (byte-level BPE: ``"Ġworld"``, a split
        character's bytes as their alphabet characters), as HF's ``convert_ids_to_tokens`` gives
        it: vLLM's /tokenize ``token_strs``. "" for an id the vocabulary lacks."""
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (OpenAI's logprobs ``bytes``). A byte-level BPE
        token may end partway through a UTF-8 character, which ``decode`` renders as U+FFFD:
        its bytes come from the vocabulary's byte alphabet instead. Tokens outside it (special
        and added tokens, other tokenizers): the UTF-8 of their text."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id in self._added:
            return piece.encode()
        if self._byte_level and piece is not None and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template (sandboxed jinja2).

        Raises ``ValueError`` for malformed messages, a missing template, or an error the template
        raises (``raise_exception``)."""
        validate_messages(messages)
        if self._template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ValueError(f"chat template: {e}") from e


class StopStringChecker:
    """Finds stop strings in streamed text.

    ``feed`` returns the text that is safe to show: it holds back a tail that could be the start
    of a stop string, and after a hit returns only the text before the stop string (``hit`` then
    names it). ``flush`` returns the held-back tail when generation ends for another reason.
    ``feed(text, check=False)`` (text of a request's first ``min_tokens`` tokens) matches nothing
    that ends in that text, as vLLM's ``min_tokens``; a stop string that starts there and ends in
    text fed later still matches, so its possible start is held back all the same.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stop = tuple(stop)
        self.hit: str | None = None
        self._held = ""
        self._unchecked = 0  # how many leading characters of _held were fed with check=False

    def feed(self, text: str, check: bool = True) -> str:
        if self.hit is not None:
            return ""
        buf = self._held + text
        # Only a match that ends past the unchecked text counts (none when this text is
        # unchecked too); the checked part of the held tail holds no complete stop string, so
        # every such match is new. Generation stops where the first stop string is complete
        # (earliest end; on a tie, the longer one): the same answer however the text is chunked.
        unchecked = len(buf) if not check else self._unchecked
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = buf.find(s, max(unchecked - len(s) + 1, 0))
            if i != -1 and (best is None or (i + len(s), i) < best):
                best, self.hit = (i + len(s), i), s
        if best is not None:
            self._held, self._unchecked = "", 0
            return buf[: best[1]]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :]
        self._unchecked = max(unchecked - (len(buf) - keep), 0)
        return buf[: len(buf) - keep]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        held, self._held, self._unchecked = self._held, "", 0
        return "" if self.hit is not None else held


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas.

    Decodes a small window of recent tokens and returns what it adds to the text. A delta ending
    in U+FFFD (a multi-byte UTF-8 character split across tokens) is held back until the next token
    completes it. With ``stop`` strings, text that could start a stop string is held back too, and
    after a hit ``stopped`` is true, ``stop_string`` names it and the text ends before it.

    ``prompt_ids`` (optional) give the decoder context, so tokenizers that strip a leading space at
    the start of a decode (SentencePiece-style) render the first generated token correctly.

    ``skip_special_tokens`` (vLLM's, default True): special tokens add no text; False: their
    text is part of the output, and of what the stop strings are matched against.
    ``spaces_between_special_tokens`` False (with ``skip_special_tokens`` False): an added token
    fed right after another adds its own text alone, whatever space the decoder would put before
    it (vLLM's fast-tokenizer detokenizer's rule); the byte-level decoder puts none.
    ``min_tokens`` (the request's, as vLLM's): no stop string matches that ends in the text of the
    first ``min_tokens`` tokens fed (one that starts there and ends later does).
    """

    # Prompt tokens used as decoding context: enough for any tokenizer's merge window.
    CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._fed = 0  # generated tokens fed so far
        self.skip_special_tokens = skip_special_tokens
        # vLLM's: the rule applies only where special tokens are kept
        self._join_added = not (skip_special_tokens or spaces_between_special_tokens)
        self._last_added = False  # the last token fed was an added token
        self._ids = list(prompt_ids[-self.CONTEXT :]) if prompt_ids else []
        # Invariant: ids[prefix:read] decode to text already emitted; ids[read:] are pending.
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = StopStringChecker(stop)
        self._pieces: list[str] = []  # everything returned so far (``text``), one piece a delta

    @property
    def text(self) -> str:
        """Everything returned so far. (Kept as pieces joined here: ``+=`` on an attribute
        copies the whole text per token.)"""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        return self._stop.hit is not None

    @property
    def stop_string(self) -> str | None:
        return self._stop.hit

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the new text that is safe to show (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._fed += 1
        if self._join_added:
            added = self.tokenizer.added_token_text(token_id)
            after_added, self._last_added = self._last_added, added is not None
            if added is not None and after_added and self._read == len(self._ids) - 1:
                # (nothing pending: the added token before it was shown whole)
                self._prefix, self._read = self._read, len(self._ids)
                return self._emit(self._stop.feed(added, self._checks_stop))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete UTF-8 sequence: wait for more bytes
        self._prefix, self._read = self._read, len(self._ids)
        return self._emit(self._stop.feed(new_text[len(prefix_text) :], self._checks_stop))

    @property
    def _checks_stop(self) -> bool:
        """The text made now may end a stop string: past the first ``min_tokens`` tokens (the
        text a token completes counts as that token's, as vLLM counts it)."""
        return self._fed > self.min_tokens

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character is
        rendered as U+FFFD; a partial stop string is shown, since no stop string followed)."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        pending = self._decode(self._ids[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        return self._emit(self._stop.feed(pending, self._checks_stop) + self._stop.flush())

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
