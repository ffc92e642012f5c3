"""KVDumpNixlConnector: the testbed's NixlConnector, plus a copy of the KV blocks on both ends.

Loaded inside a vLLM server (`kv_connector_module_path: tb_kvdump`, this folder on the
server's PYTHONPATH: `workers.vllm_server` does both when a ServerSpec has `kv_dump_dir`), so
it imports vLLM and nothing of the testbed. It moves the KV exactly as NixlConnector does (it
is that class, through tb_nixl.TestbedNixlConnector), and writes what lay in the paged KV
cache at the two moments that matter:

- on the prefill instance (`kv_producer`), when the decode instance has finished reading the
  request's blocks (NIXL's `finished_sending`): the blocks it computed, which the scheduler
  named in the request's `kv_transfer_params` (`remote_block_ids`);
- on the decode instance (`kv_consumer`), when the pull has landed (`finished_recving`),
  before any forward pass writes into those blocks: the blocks it received.

Each dump is `<dir>/<side>-<request id>.npy` (the blocks of every layer, stacked: layers x
blocks x the layer's block shape, in the cache's own dtype) and a `.json` beside it, written
last (block ids, the number of prompt tokens, the peer's request id, the layer names and the
cache layout), so a reader that sees the JSON sees a whole dump. A test pairs a decode dump
with its prefill dump by `remote_request_id` and compares them bit for bit
(tests/test_vllm.py). For verification only: a dump costs a copy of the request's KV.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from tb_nixl import TestbedNixlConnector

DIR_ENV = "TESTBED_KV_DUMP_DIR"


def _safe(name):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(name))[:200]


def _group0(block_ids):
    """The first (for a dense model: the only) KV-cache group's block ids, as ints."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        block_ids = block_ids[0]
    return [int(b) for b in block_ids]


class KVDumpNixlConnector(TestbedNixlConnector):
    """NixlConnector (pull mode) that dumps each transferred request's blocks on both ends."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._tb_dir = os.environ.get(DIR_ENV)
        self._tb_pending = {}       # scheduler side: request id -> what its dump needs
        self._tb_known = {}         # worker side: the same, as bound from the metadata
        self._tb_done = set()       # worker side: sent before its metadata was bound
        self._tb_caches = {}

    # ------------------------------------------------------------ scheduler side (prefill)
    def request_finished(self, request, block_ids):
        return self._tb_note(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._tb_note(request, super().request_finished_all_groups(request, block_ids))

    def _tb_note(self, request, result):
        delay_free, params = result
        # The params a prefill instance hands out tell the decode instance to pull
        # (`do_remote_prefill`); its blocks stay held until that read is done.
        if self._tb_dir and delay_free and params and params.get("do_remote_prefill"):
            self._tb_pending[request.request_id] = {
                "side": "prefill", "request_id": request.request_id,
                "block_ids": _group0(params.get("remote_block_ids") or ()),
                "num_tokens": int(params.get("remote_num_tokens") or 0),
                "prompt_tokens": int(request.num_prompt_tokens)}
        return result

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        meta.tb_dump = self._tb_pending
        self._tb_pending = {}
        return meta

    # ------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._tb_caches = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self._tb_known.update(getattr(connector_metadata, "tb_dump", None) or {})
        for rid in list(self._tb_done & self._tb_known.keys()):
            self._tb_done.discard(rid)
            self._tb_write(self._tb_known.pop(rid))

    def get_transfer_results(self, finished_req_ids):
        recving = {}
        if self._tb_dir and self.connector_worker is not None:
            recving = dict(getattr(self.connector_worker, "_recving_metadata", {}))
        results = super().get_transfer_results(finished_req_ids)
        if not self._tb_dir:
            return results
        for rid in results.finished_recving or ():
            meta = recving.get(rid)
            if meta is not None and meta.remote is not None:
                self._tb_write({
                    "side": "decode", "request_id": rid,
                    "block_ids": _group0(meta.local_block_ids),
                    "remote_block_ids": _group0(meta.remote.block_ids),
                    "remote_request_id": meta.remote.request_id,
                    "num_tokens": int(meta.remote.num_tokens or 0)})
        for rid in results.finished_sending or ():
            info = self._tb_known.pop(rid, None)
            if info is None:
                self._tb_done.add(rid)     # its metadata comes with a later step
            else:
                self._tb_write(info)
        return results

    def _tb_write(self, info):
        """The dump of one request; a dump that cannot be made (a hybrid model's caches of
        several shapes, say) is a JSON with its `error`, never an engine failure."""
        stem = os.path.join(self._tb_dir, f"{info['side']}-{_safe(info['request_id'])}")
        try:
            info = self._tb_blocks(stem, info)
        except Exception as e:  # verification only: the transfer itself goes on
            info = dict(info, error=f"{type(e).__name__}: {e}")
        with open(stem + ".tmp.json", "w") as f:
            json.dump(info, f)
        os.replace(stem + ".tmp.json", stem + ".json")

    def _tb_blocks(self, stem, info):
        names = sorted(self._tb_caches)
        ids = info["block_ids"]
        arrays = [self._tb_caches[n][ids].detach().cpu() for n in names]
        dtype = ",".join(sorted({str(a.dtype) for a in arrays}))
        # numpy has no bfloat16: the same bits as int16
        arrays = [a.view(torch.int16) if a.dtype == torch.bfloat16 else a for a in arrays]
        blocks = np.stack([a.numpy() for a in arrays]) if arrays and ids else np.zeros((0,))
        np.save(stem + ".tmp.npy", blocks)
        os.replace(stem + ".tmp.npy", stem + ".npy")
        first = self._tb_caches[names[0]] if names else None
        return dict(info, layers=names, dtype=dtype or str(blocks.dtype),
                    shape=list(blocks.shape), block_size=int(self._tb_block_size()),
                    cache_shape=list(first.shape) if first is not None else [])

    def _tb_block_size(self):
        worker = self.connector_worker
        return getattr(worker, "block_size", 0) if worker is not None else 0
