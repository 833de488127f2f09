"""The prompts the exactness tests compare with HF transformers: 4 to 1,200+ tokens, three that
share a long prefix (prefix-cache hits), and enough text to force chunked prefill."""

from __future__ import annotations

SHARED_PREFIX = (
    "You are a careful assistant for a platform team that runs language models on Kubernetes. "
    "The cluster has two pools of servers: prefill servers read whole prompts and build the "
    "key-value cache, decode servers generate the answer one token at a time. A router sends each "
    "request to one server of each pool, and the cache moves between them over the network. "
    "Answer briefly, and say when you are not sure. "
) * 3

FACTS = [
    "Mercury is the smallest planet and the closest to the Sun.",
    "Venus has a thick atmosphere of carbon dioxide and the hottest surface of all planets.",
    "Earth is the only planet known to support life, with liquid water on its surface.",
    "Mars is called the red planet because of iron oxide on its surface.",
    "Jupiter is the largest planet, a gas giant with a great red storm.",
    "Saturn is famous for its bright rings made of ice and rock.",
    "Uranus rotates on its side, with an axis tilted almost ninety degrees.",
    "Neptune has the strongest winds measured in the solar system.",
]


def long_text(n_sentences: int) -> str:
    return " ".join(f"Note {i}: {FACTS[i % len(FACTS)]}" for i in range(n_sentences))


def prompts(tokenizer) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        SHARED_PREFIX + "Question: what does the prefill pool do?\nAnswer:",
        SHARED_PREFIX + "Question: what does the decode pool do?\nAnswer:",
        SHARED_PREFIX + "Question: how does the cache move between pools?\nAnswer:",
        long_text(30) + "\nSummary of the notes above:",
        long_text(70) + "\nThe planet with rings is",
        long_text(90) + "\nQuestion: which planet is red? Answer:",
    ]
    ids = [tokenizer.encode(t) for t in texts]
    ids[1] = ids[1][:4]  # a 4-token prompt
    return ids
