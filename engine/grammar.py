"""Structured outputs: grammars compiled with xgrammar, and the per-step token masks they give.

A request's constraint, in order:
  GrammarSpec (what was asked: a JSON Schema, any JSON object, a regex or an EBNF grammar)
    --GrammarCompiler.compile-->  Grammar (compiled for one tokenizer; cached, shared)
    --Grammar.matcher-->          one xgrammar GrammarMatcher per sequence (Sequence.grammar)
  then, each step the sequence samples in: its allowed tokens filled into a bitmask and applied
  to its row of the logits (`apply_grammars`, before sampling), and the sampled token accepted
  when the sequence appends it (Sequence.append, from Scheduler.update). The matcher terminates
  when it accepts a stop token, and the sequence then finishes.

xgrammar is imported only when a compiler is first used (the import takes seconds), so servers
that never see a constrained request never pay for it.
"""

from __future__ import annotations

import enum
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.host_values import to_device


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF (xgrammar's / GBNF syntax) with a `root` rule


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to (tandem.v1.StructuredOutput)."""

    kind: GrammarKind
    text: str = ""
    """The JSON Schema (JSON text), the regex or the EBNF grammar; empty for JSON_OBJECT."""
    compact_whitespace: bool = False
    """JSON: no whitespace and "," ":" separators (vLLM's disable_any_whitespace)."""

    def __post_init__(self) -> None:
        if (self.kind is GrammarKind.JSON_OBJECT) != (not self.text):
            need = "must be empty" if self.kind is GrammarKind.JSON_OBJECT else "must not be empty"
            raise ValueError(f"{self.kind.value}: the text {need}")


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar matching exactly one of `choices` (vLLM's choice_as_grammar)."""
    if not (
        isinstance(choices, list | tuple) and choices and all(isinstance(c, str) for c in choices)
    ):
        raise ValueError("choice: must be a non-empty list of strings")
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


STRUCTURED_KINDS = ("json", "json_object", "regex", "grammar", "choice")
"""The constraints of vLLM's `structured_outputs` (StructuredOutputsParams) tandem serves."""


def structured_outputs_spec(value: object) -> GrammarSpec | None:
    """vLLM's `structured_outputs` field as a spec; None when absent (null). `choice` becomes
    an EBNF grammar, as vLLM's choice_as_grammar makes it. ValueError naming the key at fault;
    the grammar itself is checked by `check` (or when compiled)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object")
    unknown = set(value) - {*STRUCTURED_KINDS, "disable_any_whitespace"}
    if unknown:
        raise ValueError(f"unsupported key(s): {', '.join(sorted(unknown))}")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)} (got {len(kinds)})")
    compact = value.get("disable_any_whitespace") or False
    if not isinstance(compact, bool):
        raise ValueError(f"disable_any_whitespace: {compact!r} is not a boolean")
    kind, given = kinds[0], value[kinds[0]]
    if kind == "json":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, _schema_text(given), compact)
    if kind == "json_object":
        if given is not True:
            raise ValueError(f"json_object: {given!r}; must be true when given")
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", compact)
    if kind == "choice":
        return GrammarSpec(GrammarKind.GRAMMAR, choice_grammar(given))
    if not isinstance(given, str):
        raise ValueError(f"{kind}: must be a string")
    return GrammarSpec(GrammarKind(kind), given)


def _schema_text(schema: object) -> str:
    """A JSON Schema given as an object or as its text: its text."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    if not isinstance(schema, str):
        raise ValueError("json: must be a JSON Schema, as an object or as its text")
    try:
        json.loads(schema)
    except ValueError:
        raise ValueError("json: the JSON Schema is not JSON") from None
    return schema


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; immutable, shared by every sequence of the same spec."""

    spec: GrammarSpec
    compiled: Any
    """xgrammar.CompiledGrammar."""
    vocab_size: int
    """Width of the masks it gives: the model's vocabulary rows (its logits' width)."""

    def matcher(self, stop_token_ids: Iterable[int]) -> Any:
        """A fresh xgrammar.GrammarMatcher for one sequence. It terminates on any of
        `stop_token_ids` (vLLM passes the request's EOS and stop ids; none: the tokenizer's)."""
        import xgrammar as xgr

        stop = sorted(set(stop_token_ids))
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=stop or None)


class GrammarCompiler:
    """Compiles specs against one model's tokenizer. The tokenizer and xgrammar's compiler are
    built at the first `compile` (not at start-up: most servers never need them); compiled
    grammars are kept in an LRU cache keyed by the spec. Thread-safe: servers compile on their
    request threads, never on the engine's."""

    def __init__(self, tokenizer_folder: str, vocab_size: int, cache_size: int = 256) -> None:
        """`tokenizer_folder`: a Hugging Face model folder (or `random:<preset>`, which has no
        tokenizer: compiling then fails). `vocab_size`: the model's vocabulary rows."""
        self.tokenizer_folder = tokenizer_folder
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar; ValueError with xgrammar's message when it does not compile,
        or when the model has no tokenizer."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            compiler = self._xgrammar_compiler()
        # Outside the lock: compiling takes milliseconds, and xgrammar's compiler is thread-safe.
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(
                f"{spec.kind.value}: does not compile: {_xgrammar_message(e)}"
            ) from None
        grammar = Grammar(spec, compiled, self.vocab_size)
        with self._lock:
            self._cache[spec] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _xgrammar_compiler(self) -> Any:
        """Built once, under the lock."""
        if self._compiler is None:
            tokenizer = _load_tokenizer(self.tokenizer_folder)
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            # Our cache keeps the compiled grammars: xgrammar's would hold a second copy.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def check(spec: GrammarSpec) -> None:
    """ValueError naming the problem when `spec` does not parse. Needs no tokenizer: the router
    checks requests with it before any backend sees them."""
    import xgrammar as xgr

    parse = {GrammarKind.JSON_SCHEMA: xgr.Grammar.from_json_schema,
             GrammarKind.REGEX: xgr.Grammar.from_regex,
             GrammarKind.GRAMMAR: xgr.Grammar.from_ebnf}.get(spec.kind)  # fmt: skip
    if parse is None:  # JSON_OBJECT: a fixed grammar
        return
    try:
        parse(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{spec.kind.value}: does not compile: {_xgrammar_message(e)}") from None


def allows(matcher: Any, token_id: int) -> bool:
    """Whether `matcher` accepts `token_id` next; it is left as it was either way."""
    if not matcher.accept_token(token_id):
        return False
    matcher.rollback(1)
    return True


def apply_grammars(logits: torch.Tensor, matchers: Sequence[Any]) -> None:
    """Sets to -inf, in place, every logit of a token the row's matcher does not allow next.
    `logits`: [B, vocab] (float32), on any device; `matchers`: B entries, None for a row without
    a grammar (left untouched). The masks are filled on the host (xgrammar needs CPU int32) and
    applied on the logits' device (on CUDA: xgrammar's Triton kernel)."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    assert rows, "the caller decides on the host whether any row has a grammar"
    cuda = logits.device.type == "cuda"
    words = -(-logits.shape[1] // 32)
    # Rows of the logits' batch, so that `indices` address both; unconstrained rows are never
    # read, so left unfilled.
    bitmask = torch.empty((logits.shape[0], words), dtype=torch.int32, pin_memory=cuda)
    if len(rows) == 1:
        matchers[rows[0]].fill_next_token_bitmask(bitmask, rows[0])
    else:  # on xgrammar's threads: some 15 us a row, which a large batch would pay serially
        _batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, rows)
    indices: list[int] | torch.Tensor | None = None if len(rows) == len(matchers) else rows
    if cuda:  # from pinned memory: the copies do not wait for the device (nor it for them)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        if indices is not None:
            indices = to_device(rows, logits.device, torch.int32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)


@functools.cache
def _batch_matcher() -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    """vLLM's xgrammar backend's calls (v1/structured_output/backend_xgrammar.py)."""
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        schema = spec.text if spec.kind is GrammarKind.JSON_SCHEMA else '{"type": "object"}'
        # NOTE: any_whitespace=False alone still allows ", " and ": "; the separators remove
        # those too (as vLLM does for disable_any_whitespace).
        return compiler.compile_json_schema(
            schema,
            any_whitespace=not spec.compact_whitespace,
            separators=(",", ":") if spec.compact_whitespace else None,
        )
    if spec.kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.text)
    return compiler.compile_grammar(spec.text)


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's C++ message without its log prefix ("[12:04:31] /project/cpp/x.cc:83: ")."""
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(error).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _load_tokenizer(folder: str) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if folder.startswith("random:") or not any((Path(folder) / n).is_file() for n in names):
        raise ValueError(f"needs the model's tokenizer, and {folder} has none")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from None
