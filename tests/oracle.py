"""The independent oracle: transformers on the CPU in float32. Used by tests only."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Oracle:
    """Greedy decoding and exact next-token logits from a transformers checkpoint (fp32, CPU)."""

    def __init__(self, directory: Path, auto: str = "AutoModelForCausalLM"):
        import torch
        import transformers

        self.torch = torch
        self.model = getattr(transformers, auto).from_pretrained(
            directory, dtype=torch.float32).eval()

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), V) logits for every position, full recompute (no cache)."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids])).logits[0]
        return out.double().numpy()

    def references(self, tok, texts: list[str], n: int, min_margin: float,
                   label: str = "") -> list[tuple[list[int], list[int]]]:
        """(prompt ids, n greedy tokens) per text, each path's smallest top-1/top-2 gap asserted
        above `min_margin` (where a greedy match between frameworks means something)."""
        out = []
        for text in texts:
            ids = tok.encode(text)
            ref, margin = self.greedy(ids, n)
            assert margin > min_margin, f"{label}: near-tie on the path ({margin:.2e})"
            out.append((ids, ref))
        return out

    def greedy(self, prompt: list[int], n: int, eos: int | None = None) -> tuple[list[int], float]:
        """n greedy tokens (stopping after eos) and the smallest top-1/top-2 gap on the path."""
        ids, out, margin = list(prompt), [], np.inf
        for _ in range(n):
            last = self.logits(ids)[-1]
            top2 = np.sort(last)[-2:]
            margin = min(margin, top2[1] - top2[0])
            token = int(last.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
        return out, float(margin)


class VisionOracle(Oracle):
    """The oracle of a vision-language checkpoint (transformers' model with its vision tower),
    bound to one prompt's images: `bind(inputs)` -> an oracle whose `logits(ids)` runs `ids`
    (that prompt, then any continuation) with those pixel inputs (mlx-vlm's processor's, as
    numpy), image positions marked as transformers marks them (`marks`: Qwen3.5's
    `mm_token_type_ids`, Gemma 3's `token_type_ids`)."""

    def __init__(self, directory: Path, image_token_id: int, marks: str = "mm_token_type_ids"):
        super().__init__(directory, "AutoModelForImageTextToText")
        self.image_token_id = image_token_id
        self.marks = marks
        self.inputs: dict = {}

    def bind(self, inputs: dict) -> VisionOracle:
        bound = object.__new__(VisionOracle)
        bound.__dict__.update(self.__dict__)
        bound.inputs = {k: self.torch.tensor(np.array(v)) for k, v in inputs.items()}
        return bound

    def logits(self, ids: list[int]) -> np.ndarray:
        tokens = self.torch.tensor([ids])
        marks = {self.marks: (tokens == self.image_token_id).long()}
        with self.torch.no_grad():
            out = self.model(input_ids=tokens, **marks, **self.inputs).logits[0]
        return out.double().numpy()
