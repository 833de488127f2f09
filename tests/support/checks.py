"""The checks the engine and server tests share: an engine left clean, and output compared with
HF transformers running the same GGUF weights."""

from __future__ import annotations


def assert_engine_clean(engine) -> None:
    """Nothing running or waiting; every page free or held (unpinned) by the prefix cache."""

    def check():
        engine.scheduler.check_integrity()
        mem = engine.memory
        assert not engine.scheduler.has_work(), "requests still queued or running"
        assert mem.slots.num_free == mem.slots.num_slots, "a slot is still held"
        assert mem.allocator.num_free + mem.cache.num_pages == mem.num_pages, "pages held outside the cache"
        assert mem.cache.num_evictable == mem.cache.num_pages, "cached pages still pinned"

    engine.call(check)


def cached_prefixes(cache) -> set[tuple[int, ...]]:
    """Every page-ending token prefix a RadixCache holds, read from the tree itself."""
    out, stack = set(), [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        for i in range(0, len(node.key), cache.page_size):
            out.add(above + tuple(node.key[: i + cache.page_size]))
        stack.extend((c, above + tuple(node.key)) for c in node.children.values())
    return out


class HFReference:
    """Greedy decoding with HF transformers on the same GGUF weights (float32, CPU), or with `model`
    (a HF model in float32), recording the top-2 logit gap at every generated position. Results
    are memoized per (prompt, length)."""

    def __init__(self, model=None):
        import torch
        from transformers import AutoModelForCausalLM

        from tandem.server.model.loader import resolve_model

        self.torch = torch
        if model is None:
            source = resolve_model("builtin:smollm2-135m")
            model = AutoModelForCausalLM.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
            )
        self.model = model.eval()
        self._memo: dict = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._memo:
            torch = self.torch
            tokens, gaps = [], []
            with torch.inference_mode():
                out = self.model(torch.tensor([prompt_ids]), use_cache=True)
                for _ in range(max_new_tokens):
                    logits = out.logits[0, -1].float()
                    top2 = logits.topk(2).values
                    gaps.append(float(top2[0] - top2[1]))
                    nxt = int(logits.argmax())
                    tokens.append(nxt)
                    out = self.model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            self._memo[key] = (tokens, gaps)
        return self._memo[key]


def assert_matches_reference(got: list[int], want: list[int], gaps: list[float], label: str = "",
                             tolerance: float = 1e-3) -> None:
    """Token-identical, except that a divergence is tolerated where the reference's top-2 logit
    gap is below `tolerance` (a near tie that rounding may flip: 1e-3 for float32 math, more for a
    path that rounds to 16 bits); comparison stops there."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < tolerance, (
                f"{label}: token {i} differs ({a} != {b}) where the reference's top-2 gap is {gaps[i]:.3g}"
            )
            return
    assert len(got) == len(want), f"{label}: {len(got)} tokens, reference has {len(want)}"


def reference_workload(hf_reference, prompt_ids: list[list[int]], new_tokens: int) -> list[tuple]:
    """[(prompt, HF's greedy output of `new_tokens` tokens, its top-2 logit gaps)]: what
    run_and_compare() takes."""
    return [(p, *hf_reference.greedy(p, new_tokens)) for p in prompt_ids]


def run_and_compare(engine, workload: list[tuple], label: str, tolerance: float = 1e-3) -> list:
    """Every prompt of `workload` (reference_workload()) submitted to `engine` at once, greedy with
    EOS ignored, for as many tokens as the reference has; each finishes by length with the
    reference's tokens up to a near tie below `tolerance` (assert_matches_reference). Returns the
    results in workload order. "At once": from the loop's own thread between two steps, so that its
    next step sees them all (submitted from here, the loop could start on the first before the last
    arrived, and a schedule a test sized its pool for, to retract, would depend on the machine)."""
    from tandem.server.scheduling.sampling_params import SamplingParams

    streams = engine.call(lambda: [
        engine.submit(p, SamplingParams(max_new_tokens=len(want), temperature=0.0, ignore_eos=True))
        for p, want, _ in workload])
    results = [s.result() for s in streams]
    for i, (r, (p, want, gaps)) in enumerate(zip(results, workload)):
        assert r.finish_reason == "length", f"{label} prompt {i}: {r.finish_reason} {r.error}"
        assert_matches_reference(r.output_ids, want, gaps, f"{label} prompt {i} ({len(p)} tokens)", tolerance=tolerance)
    return results


def assert_greedy_matches_reference(model, hf_reference, prompt_ids: list[list[int]], new_tokens: int, tolerance: float,
                                    **config) -> None:
    """All prompts through one Engine on `model` (EngineConfig `config`) by run_and_compare(), up to
    a near tie below `tolerance`; the engine left clean."""
    from tandem.server.config import EngineConfig
    from tandem.server.loop.engine import Engine

    with Engine(EngineConfig(**config), model=model) as engine:
        run_and_compare(engine, reference_workload(hf_reference, prompt_ids, new_tokens), "greedy", tolerance)
        assert_engine_clean(engine)
