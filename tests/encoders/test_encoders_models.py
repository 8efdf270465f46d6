"""The python-backend model files' own logic (run without Triton), and encoder helpers."""

from __future__ import annotations

import numpy as np
import pytest

from forge.in_triton.encoder_models.onnx_encoder import check_request, merge
from forge.in_triton.encoder_models.tokenizer import TextTokenizer, decode_texts
from forge.encoder.onnx_quant import trt_cache_header, write_trt_cache


def test_merge_pads_ragged_requests_with_zeros():
    a = np.array([[1, 2, 3]], dtype=np.int32)
    b = np.array([[4], [5]], dtype=np.int32)
    merged = merge([a, b])
    np.testing.assert_array_equal(merged, [[1, 2, 3], [4, 0, 0], [5, 0, 0]])
    assert merged.dtype == np.int32 and merge([a]) is a


def test_requests_without_rows_or_with_mismatched_batches_are_refused():
    with pytest.raises(ValueError, match="empty batch"):
        check_request({"input_ids": np.zeros((0, 3), dtype=np.int32)})
    with pytest.raises(ValueError, match="different batch sizes"):
        check_request({"input_ids": np.zeros((2, 3)), "attention_mask": np.zeros((1, 3))})


def test_text_tensor_decoding():
    """UTF-8 rows decode; invalid UTF-8, empty batches and wrong shapes raise ValueError."""
    assert decode_texts(np.array([[b"caf\xc3\xa9"], [""]], dtype=object)) == ["café", ""]
    with pytest.raises(ValueError, match="text 1 is not valid UTF-8"):
        decode_texts(np.array([[b"ok"], [b"\xc3\x28"]], dtype=object))
    with pytest.raises(ValueError, match="empty batch"):
        decode_texts(np.zeros((0, 1), dtype=object))
    with pytest.raises(ValueError, match=r"shape \[batch, 1\]"):
        decode_texts(np.array([b"a", b"b"], dtype=object))


def test_tokenizer_truncates_keeping_special_tokens_and_pads(minilm_model):
    tokenizer = TextTokenizer(str(minilm_model / "tokenizer.json"), max_length=8, pad_id=0)
    out = tokenizer(["hello world", "one two three four five six seven eight nine"])
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == (2, 8) and ids.dtype == np.int32
    assert ids[0].tolist()[:4] == [101, 7592, 2088, 102] and ids[0, 4:].tolist() == [0] * 4
    assert ids[1, 0] == 101 and ids[1, -1] == 102 and mask[1].sum() == 8 and mask[0].sum() == 4
    fixed = TextTokenizer(str(minilm_model / "tokenizer.json"), max_length=8, padding="max_length",
                          outputs=("input_ids",))(["hi"])
    assert list(fixed) == ["input_ids"] and fixed["input_ids"].shape == (1, 8)


def test_trt_calibration_cache_format(tmp_path):
    assert trt_cache_header("10.3.0") == "TRT-100300-EntropyCalibration2"
    assert trt_cache_header("8.6.1") == "TRT-8601-EntropyCalibration2"
    write_trt_cache(tmp_path / "c", {"x": 127.0, "y": 1.0}, "10.3.0")
    assert (tmp_path / "c").read_text().splitlines() == ["TRT-100300-EntropyCalibration2", "x: 3f800000",
                                                         "y: 3c010204"]
