"""docs/python.md's worked example, run as it is written there, with a look-alike causal LM (Qwen3-MoE
5.x block shapes, 21 layers) and tokenizer standing in for the checkpoint: transformers is replaced by
a stub module for the duration of the test."""

import json
import math
import os
import re
import sys
import types

import pytest

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed for this interpreter (Debian: python3-torch)", allow_module_level=True)

import moefq
from hf_lookalikes import ForCausalLM, Qwen3MoeSparseMoeBlock

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")
HEADING = "### A worked example: capture the MoE inputs, quantize the whole model"


def example_code():
    text = open(DOCS).read()
    after = text[text.index(HEADING):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


class LookAlikeLM(torch.nn.Module):
    """A causal LM: model.layers.{i}.mlp, 21 Qwen3-MoE blocks (every layer, as in Qwen3-30B-A3B), .logits out."""

    def __init__(self):
        super().__init__()
        inner = ForCausalLM(32, [Qwen3MoeSparseMoeBlock() for _ in range(21)], seed=3)
        self.model = inner.model
        self.lm_head = torch.nn.Linear(32, 50, bias=False).bfloat16()
        torch.nn.init.normal_(self.lm_head.weight, std=0.5)

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, ids):
        return types.SimpleNamespace(logits=self.lm_head(self.model(ids)))


class Tokenized:
    def __init__(self, text):
        self.input_ids = torch.tensor([[(ord(c) * 7 + i) % 50 for i, c in enumerate(text)]])


@pytest.fixture
def stub_transformers(monkeypatch):
    created = []

    class AutoModelForCausalLM:
        @staticmethod
        def from_pretrained(name, **kwargs):
            assert name == "Qwen/Qwen3-30B-A3B" and kwargs["dtype"] == torch.bfloat16
            created.append(LookAlikeLM())
            return created[-1]

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(name):
            return lambda text, return_tensors: Tokenized(text)

    stub = types.ModuleType("transformers")
    stub.AutoModelForCausalLM, stub.AutoTokenizer = AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setitem(sys.modules, "transformers", stub)
    return created


def test_worked_example_runs_as_written(stub_transformers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"calibration_texts": ["the quick brown fox jumps over the lazy dog" * 2, "moefq quantizes the combine"],
          "held_out_texts": ["a held out sentence about mixtures of experts", "another one, somewhat longer " * 3]}
    exec(compile(example_code(), "docs/python.md", "exec"), ns)
    model = stub_transformers[0]
    base, order_only, nvfp4, first_four = ns["base"], ns["order_only"], ns["combine_nvfp4"], ns["first_four"]
    assert all(math.isfinite(v) for v in (base, order_only, nvfp4, first_four))
    assert abs(order_only - base) / base < 1e-2  # the summation order alone: nearly nothing
    assert nvfp4 != base and first_four != base
    # Step 1 wrote the two layers' inputs, step 2 the calibration of the 21 combine quantizers.
    assert sorted(moefq.load_safetensors("acts.safetensors")) == ["layers.20", "layers.3"]
    calib = json.loads(open("calib.json").read())
    assert "model.layers.20.mlp.experts.combine_quantizer" in json.dumps(calib)
    # Every quantize_moe was undone.
    assert getattr(model, "_moefq_quantization", None) is None
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
