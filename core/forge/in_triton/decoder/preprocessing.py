"""forge's ``preprocessing`` model: text → token ids, stop/bad word lists, end/pad ids, logit bias.

Runs in Triton's python backend (copied into a repository as ``preprocessing/1/model.py``). The
tensor names and dtypes come from the model's own config.pbtxt, which forge writes for the chosen
tensorrtllm_backend version, so one file serves every version. Optional outputs whose inputs are
absent are not produced; the ensemble then leaves the matching tensorrt_llm input unset.
"""

import os
import sys

# Text work only: one OpenMP thread, so this process never competes with the decoder for cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forge_glue  # noqa: E402  (shipped next to this file)
import forge_text  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config, params, self.tokenizer = forge_text.model_setup(args)
        self.add_special_tokens = forge_text.parse_bool(params.get("add_special_tokens"), True)
        eos = self.tokenizer.eos_token_id
        self.end_id = int(params.get("end_id") or (eos if eos is not None else 0))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(params.get("pad_id") or (pad if pad is not None else self.end_id))
        self.stop_token_ids = [int(t) for t in (params.get("stop_token_ids") or "").split(",") if t.strip()]
        self.vocab_size = int(params.get("vocab_size") or len(self.tokenizer))
        self.max_input_len = int(params.get("max_input_len") or 0)
        # multimodal repositories: the image placeholder becomes the prompt table's ids (forge_text.expand_image)
        self.image_token_id = int(params["image_token_id"]) if params.get("image_token_id") else None
        self.image_placeholder = params.get("image_placeholder") or "<image>"
        self.inputs = {t["name"] for t in config["input"]}
        self.dtypes = {t["name"]: pb_utils.triton_string_to_numpy(t["data_type"]) for t in config["output"]}

    def execute(self, requests):
        return forge_glue.run_each(requests, self._process)

    # -- one request -----------------------------------------------------------------------
    def _get(self, request, name):
        return forge_glue.get(request, name, self.inputs)

    def _out(self, name, value):
        return pb_utils.Tensor(name, np.ascontiguousarray(value, dtype=self.dtypes[name]))

    def _ids(self, request, name, default, batch):
        """END_ID / PAD_ID of every row: the request's value, else the tokenizer's."""
        given = self._get(request, name)
        if given is None:
            return np.full((batch, 1), default, dtype=np.int64)
        return given.reshape(batch, -1)[:, :1].astype(np.int64)

    def _tokenize(self, texts, what, table_rows=None):
        rows = []
        for index, row in enumerate(texts):
            text = row.reshape(-1)[0] if np.ndim(row) else row
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            ids = forge_text.token_ids(text, self.tokenizer, self.add_special_tokens)
            if self.image_token_id is not None:
                ids = forge_text.expand_image(ids, self.image_token_id, self.image_placeholder, self.vocab_size,
                                              0 if table_rows is None else int(table_rows.reshape(-1)[index]))
            if not ids:
                raise ValueError(f"{what} of batch row {index} is empty after tokenization")
            if self.max_input_len and len(ids) > self.max_input_len:
                raise ValueError(f"{what} of batch row {index} has {len(ids)} tokens; this model accepts at "
                                 f"most {self.max_input_len} (the engine's max_input_len)")
            rows.append(ids)
        width = max(len(ids) for ids in rows)
        padded = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        for index, ids in enumerate(rows):
            padded[index, :len(ids)] = ids
        lengths = np.array([[len(ids)] for ids in rows], dtype=np.int64)
        return padded, lengths

    def _process(self, request):
        query = self._get(request, "QUERY")
        batch = query.shape[0]
        out = []
        input_ids, input_lengths = self._tokenize(query, "text_input", self._get(request, "PROMPT_VOCAB_SIZE"))
        out.append(self._out("INPUT_ID", input_ids))
        out.append(self._out("REQUEST_INPUT_LEN", input_lengths))

        output_len = self._get(request, "REQUEST_OUTPUT_LEN")
        if output_len is not None:
            if np.any(output_len.astype(np.int64) < 0):
                raise ValueError("max_tokens must not be negative")
            out.append(self._out("REQUEST_OUTPUT_LEN", output_len.reshape(batch, -1)[:, :1]))

        pad_ids = self._ids(request, "PAD_ID", self.pad_id, batch)
        if "DECODER_INPUT_ID" in self.dtypes:
            decoder_query = self._get(request, "DECODER_QUERY")
            if decoder_query is not None:
                ids, lengths = self._tokenize(decoder_query, "decoder_text_input")
            else:  # the backend's placeholder: one pad token per row
                ids, lengths = pad_ids, np.ones((batch, 1), dtype=np.int64)
            out.append(self._out("DECODER_INPUT_ID", ids))
            out.append(self._out("REQUEST_DECODER_INPUT_LEN", lengths))

        for words_name, ids_name, extra in (("BAD_WORDS_DICT", "BAD_WORDS_IDS", ()),
                                            ("STOP_WORDS_DICT", "STOP_WORDS_IDS", self.stop_token_ids)):
            if ids_name in self.dtypes:
                words = self._get(request, words_name)
                out.append(self._out(ids_name, forge_text.word_list(words, batch, self.tokenizer, extra)))

        bias_words = self._get(request, "EMBEDDING_BIAS_WORDS")
        bias_weights = self._get(request, "EMBEDDING_BIAS_WEIGHTS")
        if (bias_words is None) != (bias_weights is None) and "EMBEDDING_BIAS" in self.dtypes:
            raise ValueError("embedding_bias_words and embedding_bias_weights must be given together")
        if "EMBEDDING_BIAS" in self.dtypes:
            bias = np.empty((batch, 0)) if bias_words is None else forge_text.embedding_bias(
                bias_words, bias_weights, self.vocab_size, self.tokenizer)
            out.append(self._out("EMBEDDING_BIAS", bias))

        for name, value in (("OUT_END_ID", self._ids(request, "END_ID", self.end_id, batch)),
                            ("OUT_PAD_ID", pad_ids)):
            if name in self.dtypes:
                out.append(self._out(name, value))

        extra_id = self._get(request, "PROMPT_TABLE_EXTRA_ID")
        if extra_id is not None and "OUT_PROMPT_TABLE_EXTRA_IDS" in self.dtypes:
            # Prompt-table tokens (ids past the vocabulary) carry the request's extra id for KV reuse.
            extra = extra_id.reshape(batch, -1)[:, :1].astype(np.uint64)
            out.append(self._out("OUT_PROMPT_TABLE_EXTRA_IDS",
                                 np.where(input_ids >= self.vocab_size, extra, 0)))

        table = self._get(request, "PROMPT_EMBEDDING_TABLE")
        if table is not None and "OUT_PROMPT_EMBEDDING_TABLE" in self.dtypes:
            out.append(self._out("OUT_PROMPT_EMBEDDING_TABLE", table))
        return out
