"""Reading a GGUF's vocabulary and writing a copy with fewer tokens, with llama.cpp's `gguf`.

Everything that counts or names tokens changes together, or llama.cpp refuses the file (it
checks the embedding's rows against the token list) or, worse, loads one that reads wrong:
the per-token arrays (text, type, score), the merge list, the special token ids (bos, eos,
pad, …), `<arch>.vocab_size` where the converter wrote it, and the rows of the token
embedding and of the output matrix (whole rows, so any quantisation type slices as bytes).
Every other field and tensor is copied as it is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, ReaderField

from shared.errors import TrimRejected
from shared.vocab_trim.selection import Selection, Vocabulary

TOKENS = "tokenizer.ggml.tokens"
MERGES = "tokenizer.ggml.merges"
# The tensors with one row per token: the input embedding, and the output matrix unless tied.
VOCAB_TENSORS = ("token_embd.weight", "output.weight")
PROVENANCE = "granary.vocab_trim"


def field_value(reader: GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def read_vocabulary(reader: GGUFReader) -> Vocabulary:
    tokens = field_value(reader, TOKENS)
    if not isinstance(tokens, list):
        raise TrimRejected("cannot trim: the model has no token list (tokenizer.ggml.tokens)")
    scores = field_value(reader, "tokenizer.ggml.scores")
    return Vocabulary(
        model=str(field_value(reader, "tokenizer.ggml.model")),
        tokens=tokens,
        types=list(field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)),  # type: ignore[call-overload]
        merges=list(field_value(reader, MERGES) or []),  # type: ignore[call-overload]
        scores=list(scores) if isinstance(scores, list) else None,
    )


def special_ids(reader: GGUFReader) -> dict[str, int]:
    """The tokenizer's special token ids (bos, eos, pad, eot, fim_...) by key (set ones)."""
    ids = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            value = int(field.contents())
            if value >= 0:
                ids[name] = value
    return ids


def write_trimmed(
    reader: GGUFReader, selection: Selection, target: Path, provenance: dict[str, str]
) -> None:
    """Write `reader`'s model keeping only `selection`'s tokens to `target`."""
    arch = str(field_value(reader, "general.architecture"))
    n_vocab = len(field_value(reader, TOKENS))  # type: ignore[arg-type]
    writer = GGUFWriter(str(target), arch=arch, endianess=reader.endianess)
    alignment = field_value(reader, "general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment)  # type: ignore[call-overload]
    for name, field in reader.fields.items():
        if name == "general.architecture" or name.startswith(("GGUF.", PROVENANCE)):
            continue  # the writer writes these itself; a trim of a trim says where it came from
        _copy_field(writer, field, _trimmed_value(name, field, selection, n_vocab, arch))
    for key, value in provenance.items():
        writer.add_string(f"{PROVENANCE}.{key}", value)
    tensors = [(t, _trimmed_rows(t.name, t.data, selection, n_vocab)) for t in reader.tensors]
    for tensor, data in tensors:
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()


def _trimmed_value(
    name: str, field: ReaderField, selection: Selection, n_vocab: int, arch: str
) -> object:
    value = field.contents()
    if name == MERGES:
        return selection.merges
    if name == f"{arch}.vocab_size":
        return len(selection.kept)
    if name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
        old = int(value)
        return selection.new_ids()[old] if old >= 0 else old
    if name.startswith("tokenizer.ggml.") and isinstance(value, list) and len(value) == n_vocab:
        return [value[i] for i in selection.kept]  # tokens, token types, scores
    return value


def _copy_field(writer: GGUFWriter, field: ReaderField, value: object) -> None:
    kind = field.types[0]
    sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, value, kind, sub_type=sub_type)


def _trimmed_rows(name: str, data: np.ndarray, selection: Selection, n_vocab: int) -> np.ndarray:
    if name not in VOCAB_TENSORS:
        return data
    if data.shape[0] != n_vocab:
        raise TrimRejected(f"cannot trim: {name} has {data.shape[0]} rows for {n_vocab} tokens")
    return np.ascontiguousarray(data[selection.kept])
