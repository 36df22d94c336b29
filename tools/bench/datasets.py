"""What the benchmark sends, generated reproducibly from a seed.

- random: one-turn requests on /v1/completions, each prompt `input_len` tokens of random text
  (exactly, with the server's tokenizer; about, with random words) and `output_len` tokens asked
  for.
- agentic: multi-turn conversations on /v1/chat/completions shaped like a coding agent's: a long
  system prompt shared by all conversations (instructions, tool descriptions), a task, then one
  tool result per turn (a file read, a test run, a grep). The runner sends each turn with the
  whole history, the assistant's actual replies included, so the context grows turn by turn.
  Their text is words and code-like lines; a tokenizer, when given, only measures it.

Same seed, same arguments, same tokenizer → the same conversations, byte for byte.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# NOTE: word lists are written as prose, split once (SIM905 would spell them one word per line).
_WORDS = """
the of and to in is that for it as with was on be by at this from or have an are not but
all they which one you had were can there their what when been has more will would so out
if about up into time them some could other than then now only its over also after use two
how our work first well way even new want because any these give day most us value file
test data list path error check cache state queue block token batch model layer step call
return config server client request result thread buffer index count limit size offset
""".split()  # noqa: SIM905
_NAMES = """
load save parse build send read write merge split fetch update handle resolve
""".split()  # noqa: SIM905
_DIRS = """
src lib core api utils tests server client engine storage
""".split()  # noqa: SIM905


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Turn:
    text: str
    """The prompt (completions), or this turn's new user message (chat)."""
    output_len: int
    """Output tokens asked for (`max_tokens`)."""


@dataclass(frozen=True)
class Conversation:
    """One unit of load: a random request is a one-turn conversation."""

    endpoint: Endpoint
    turns: tuple[Turn, ...]
    system: str = ""
    """Chat only: the system message ("" for none)."""


class TextSource(Protocol):
    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Random text of about `num_tokens` tokens."""

    def count(self, text: str) -> int:
        """Tokens in `text`, exactly or as estimated."""


class WordText:
    """Random common English words, needing no tokenizer so that the benchmark runs against any
    server (whose `usage` then reports the exact prompt lengths). Counts estimate a BPE
    tokenizer's: one token per word, digit and punctuation mark."""

    _TOKEN = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]")

    def text(self, rng: random.Random, num_tokens: int) -> str:
        return " ".join(rng.choices(_WORDS, k=num_tokens))

    def count(self, text: str) -> int:
        return len(self._TOKEN.findall(text))


class TokenizerText:
    """Text of an exact token count under the server's tokenizer (a Hugging Face tokenizer):
    random token ids, decoded, re-encoded and trimmed or topped up until the round trip holds
    (decoding then encoding can merge or split tokens at the joins)."""

    ROUND_TRIPS = 10

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self._vocab = [i for i in range(tokenizer.vocab_size) if i not in special]

    def text(self, rng: random.Random, num_tokens: int) -> str:
        ids = rng.choices(self._vocab, k=num_tokens)
        for _ in range(self.ROUND_TRIPS):
            text = self._tokenizer.decode(ids)
            ids = self._encode(text)
            if len(ids) == num_tokens:
                return text
            ids = ids[:num_tokens] + rng.choices(self._vocab, k=max(0, num_tokens - len(ids)))
        return self._tokenizer.decode(ids)  # NOTE: rarely reached; then off by a few tokens

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False, verbose=False)


def random_dataset(
    source: TextSource, num_prompts: int, input_len: int, output_len: int, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    return [
        Conversation(Endpoint.COMPLETIONS, (Turn(source.text(rng, input_len), output_len),))
        for _ in range(num_prompts)
    ]


def agentic_dataset(
    source: TextSource,
    num_conversations: int,
    num_turns: int,
    system_len: int,
    turn_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    """`turn_len` is the mean length of a turn's new user message: tool results vary in size,
    so each is drawn uniformly from [turn_len / 2, 3 * turn_len / 2]."""
    rng = random.Random(seed)
    system = _system_prompt(rng, source, system_len)
    conversations = []
    for _ in range(num_conversations):
        texts = [_task(rng, source, turn_len)]
        texts += [_tool_result(rng, source, _vary(rng, turn_len)) for _ in range(num_turns - 1)]
        turns = tuple(Turn(text, output_len) for text in texts)
        conversations.append(Conversation(Endpoint.CHAT, turns, system))
    return conversations


def _vary(rng: random.Random, mean: int) -> int:
    return rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))


def _system_prompt(rng: random.Random, source: TextSource, num_tokens: int) -> str:
    head = (
        "You are a coding agent working in a git repository. Use one tool per step and wait "
        "for its result.\nTools:\n- read_file(path): the file's contents\n"
        "- bash(command): runs a shell command, returns its output\n"
        "- grep(pattern, path): matching lines\n- edit_file(path, old, new): replaces text\n"
        "Guidelines:\n"
    )
    return _lines(rng, source, num_tokens, head, _guideline_line)


def _task(rng: random.Random, source: TextSource, num_tokens: int) -> str:
    head = f"Task: the test {_path(rng, 'tests')} fails since the last change; fix it. Notes:\n"
    return _lines(rng, source, num_tokens, head, _guideline_line)


def _tool_result(rng: random.Random, source: TextSource, num_tokens: int) -> str:
    tool, make_line = rng.choice(_TOOLS)
    head = f"Tool result ({tool} {_path(rng, rng.choice(_DIRS))}):\n"
    return _lines(rng, source, num_tokens, head, make_line)


def _lines(
    rng: random.Random,
    source: TextSource,
    num_tokens: int,
    head: str,
    make_line: Callable[[random.Random], str],
) -> str:
    """`head`, then lines from `make_line` until the text has about `num_tokens` tokens."""
    lines, used = [head], source.count(head)
    while used < num_tokens:
        line = make_line(rng) + "\n"
        lines.append(line)
        used += source.count(line)
    return "".join(lines)


def _path(rng: random.Random, top: str) -> str:
    return f"{top}/{rng.choice(_DIRS)}/{rng.choice(_WORDS)}_{rng.choice(_NAMES)}.py"


def _code_line(rng: random.Random) -> str:
    name, value, other = rng.choice(_NAMES), rng.choice(_WORDS), rng.choice(_WORDS)
    return rng.choice(
        [
            f"def {name}_{value}({other}, {rng.choice(_WORDS)}_{rng.choice(_WORDS)}):",
            f"    {value} = self.{other}.get({rng.choice(_WORDS)!r}, {rng.randint(0, 512)})",
            f"    if {value} is None or {value} > {other}:",
            f"        return {name}_{other}({value})",
            f"    # {' '.join(rng.choices(_WORDS, k=8))}",
        ]
    )


def _guideline_line(rng: random.Random) -> str:
    return f"- {' '.join(rng.choices(_WORDS, k=rng.randint(6, 16)))}."


def _log_line(rng: random.Random) -> str:
    outcome = rng.choice(["PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"])
    return f"{_path(rng, 'tests')}::test_{rng.choice(_NAMES)}_{rng.choice(_WORDS)} {outcome}"


def _grep_line(rng: random.Random) -> str:
    return f"{_path(rng, rng.choice(_DIRS))}:{rng.randint(1, 900)}:{_code_line(rng)}"


_TOOLS: list[tuple[str, Callable[[random.Random], str]]] = [
    ("read_file", _code_line),
    ("bash pytest", _log_line),
    ("grep", _grep_line),
]
