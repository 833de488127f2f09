"""Structured output: a request's constraint (a regex, a JSON schema, an EBNF grammar or a structural
tag) compiled with xgrammar against the model's tokenizer, and the matcher that follows its output.

Compiling happens on the submitting thread, never on the engine loop, through a small pool that
bounds its time (`--grammar-compile-timeout`); xgrammar's compiler caches each grammar by its text,
so the second request with a schema pays microseconds. A constraint that does not compile is an
InvalidRequestError naming its field, raised before anything is allocated for the request.

A Matcher is made with its request and then has one user at a time: the engine thread accepts a
first token that arrived from a prefill server before any step runs the request; afterwards only
the runner (the thread that samples) reads its bitmask and advances it with each sampled token.
Nothing ever rolls a matcher back: a retracted request keeps every token it sampled, so its matcher
is already where its output is. The grammar's stop tokens are the model's EOS ids: a constrained
request that samples one has completed its grammar, and ends (even with ignore_eos).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from tandem.server.scheduling.sampling_params import Constraint, InvalidRequestError

log = logging.getLogger("tandem.grammar")

# Compiled grammars kept (xgrammar's cache, by text) before the least recently used go.
CACHE_LIMIT_BYTES = 256 << 20
COMPILE_WORKERS = 2
# Constraints remembered (by a hash of their text) to count cache hits; the counts are approximate
# for servers that see more distinct ones.
SEEN_LIMIT = 65536


@dataclass
class CompileStats:
    """Counters for the metrics layer: compilations (cache misses), cache hits, seconds spent."""

    compiled: int = 0
    cache_hits: int = 0
    seconds: float = 0.0


class Matcher:
    """One request's position in its grammar (xgrammar's GrammarMatcher)."""

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it."""
        return self._m.accept_token(token)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


def token_bitmask(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next, packed 32 to an int32 word: [len(matchers), ceil(V / 32)]
    on the CPU (bit j of word w allows token 32 * w + j)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill(bitmask, row)
    return bitmask


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer (`eos_token_ids`: the grammar's stop tokens);
    thread-safe. The tokenizer's vocabulary is read on the first constrained request (~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], timeout: float):
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.timeout = tokenizer, vocab_size, eos_token_ids, timeout
        self.stats = CompileStats()
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="tandem-grammar")
        self._lock = threading.Lock()  # guards _compiler's creation and `stats`
        self._compiler = None
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of recent constraints, oldest first

    def prepare(self) -> None:
        """Read the tokenizer's vocabulary now rather than on the first constrained request."""
        self._xgrammar_compiler()

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar; raises InvalidRequestError."""
        import xgrammar

        return Matcher(xgrammar.GrammarMatcher(self.compile(constraint)))

    def compile(self, constraint: Constraint):
        """xgrammar's CompiledGrammar for `constraint`, within the time limit."""
        future = self._pool.submit(self._compile, constraint)
        try:
            return future.result(self.timeout)
        except FutureTimeout:
            # The worker cannot be interrupted; it finishes in the background and fills the cache.
            raise InvalidRequestError(constraint.kind, f"did not compile within {self.timeout:g} s "
                                                       "(--grammar-compile-timeout)") from None

    def _compile(self, constraint: Constraint):
        compiler = self._xgrammar_compiler()
        start = time.perf_counter()
        try:
            compiled = self._call(compiler, constraint)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports every parse and conversion failure as an exception
            raise InvalidRequestError(constraint.kind, f"does not compile: {_reason(e)}") from None
        seconds = time.perf_counter() - start
        key = hash(constraint)
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                self.stats.cache_hits += 1
            else:
                self._seen[key] = None
                if len(self._seen) > SEEN_LIMIT:
                    self._seen.popitem(last=False)
                self.stats.compiled += 1
                self.stats.seconds += seconds
                log.info("compiled a %s constraint (%d bytes) in %.1f ms", constraint.kind, len(constraint.text),
                         seconds * 1e3)
        return compiled

    @staticmethod
    def _call(compiler, constraint: Constraint):
        text = constraint.text
        if constraint.kind == "regex":
            return compiler.compile_regex(text)
        if constraint.kind == "ebnf_grammar":
            return compiler.compile_grammar(text)
        if constraint.kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise InvalidRequestError("json_schema", f"is not valid JSON: {e}") from None
            # Compact JSON: free whitespace lets a small model pad its output with newlines forever.
            return compiler.compile_json_schema(json.dumps(_bounded_strings_as_patterns(schema)), any_whitespace=False)
        return compiler.compile_structural_tag(*_structural_tag(text))

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=sorted(self.eos_token_ids))
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_WORKERS,
                                                          cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# A JSON string's characters, unescaped: anything but a quote, a backslash or a control character.
_PLAIN_CHARACTER = r'[^"\\\x00-\x1f]'


def _bounded_strings_as_patterns(schema):
    """`schema` with each string's minLength/maxLength written as the equivalent pattern. xgrammar
    0.2.8 turns a length-bounded string into a repetition of any character but a quote, a backslash,
    CR or LF: raw control characters (a tab, a form feed) get in, and no JSON parser accepts them
    inside a string (seen on a GPU run: a form feed in a `maxLength` string). A pattern keeps to the
    character class it gives. Escapes are excluded either way. A string that already has a pattern
    or a format is left as it is."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings_as_patterns(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    bounded = "minLength" in out or "maxLength" in out
    if is_string and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{high}}}$"
    return out


def _structural_tag(text: str) -> tuple:
    """compile_structural_tag's arguments. SGLang's and OpenAI's form ({"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}) becomes xgrammar's tags and triggers; anything else is
    xgrammar's own format, passed as it is."""
    import xgrammar

    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError("structural_tag", f"is not valid JSON: {e}") from None
    if isinstance(value, dict) and "structures" in value:
        try:
            tags = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in value["structures"]]
            return tags, list(value["triggers"])
        except (KeyError, TypeError) as e:
            raise InvalidRequestError("structural_tag", f"each structure needs begin, schema and end, and the tag "
                                                        f"needs triggers: {e!r}") from None
    return (text,)


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ('[12:00:00] file.cc:83: ...')."""
    message = str(error).strip()
    if message.startswith("[") and ": " in message:
        message = message.split(": ", 1)[1]
        if ".cc:" in message.split(" ", 1)[0]:
            message = message.split(": ", 1)[-1]
    if " is false: " in message:  # a failed internal check: its condition, then the reason
        message = message.split(" is false: ", 1)[1]
    return message.splitlines()[0] if message else type(error).__name__
