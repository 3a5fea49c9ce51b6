#!/usr/bin/env python3
"""L3 rollout side through the Python binding (docs/validation.md section 4).

Reads the golden inputs that `detlogp harness l3-export --dir DIR` wrote (one safetensors file per
case), runs every case one row at a time through `detlogp.linear_logp(..., return_logits=True)`
(the serving entry, as a vLLM-style sampler calls it), and writes a `detlogp-l3-v1` file that
`detlogp harness l3-check` compares with the C++ trainer side (packed, vocab-parallel, another
process). Only numpy and the detlogp package are needed.

    python3 tools/l3_rollout.py --inputs DIR --out rollout-python.safetensors [--strict] [--backend ID]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

import detlogp

_DTYPES = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def read_safetensors(path):
    """(tensors, metadata) of a safetensors file; bf16 stays as uint16 bit patterns."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=_DTYPES[info["dtype"]])
        tensors[name] = arr.reshape(info["shape"]).copy()
    return tensors, meta


def write_safetensors(path, tensors, metadata):
    """Tensors (float32 arrays) in insertion order, 8-byte aligned header, written atomically."""
    header, offset, blobs = {"__metadata__": metadata}, 0, []
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", required=True, help="directory written by `detlogp harness l3-export`")
    ap.add_argument("--out", required=True, help="result file (detlogp-l3-v1 safetensors)")
    ap.add_argument("--strict", action="store_true", help="contract-bearing backends only, no fallback")
    ap.add_argument("--backend", default=None, help="backend id (default auto)")
    args = ap.parse_args(argv)

    files = sorted(f for f in os.listdir(args.inputs) if f.endswith(".safetensors"))
    if not files:
        sys.exit(f"l3_rollout: no .safetensors inputs in {args.inputs}")
    out, meta = {}, {}
    backend = provenance = None
    calls, fallback = 0, "no"
    for fname in files:
        t, m = read_safetensors(os.path.join(args.inputs, fname))
        case = m["case"]
        hidden, weight, targets = t["hidden"], t["weight"], t["targets"]
        bias, temperature = t.get("bias"), t["temperature"]
        n = hidden.shape[0]
        logp = np.empty(n, np.float32)
        lse = np.empty(n, np.float32)
        for i in range(n):  # one row at a time: the sampler's shape of call
            temp = float(temperature) if temperature.ndim == 0 else temperature[i : i + 1]
            r = detlogp.linear_logp(
                hidden[i : i + 1], weight, targets[i : i + 1], bias=bias, temperature=temp,
                ignore_index=int(m["ignore_index"]), return_logits=True, real_vocab=int(m["real_vocab"]),
                backend=args.backend, strict=args.strict or None,
            )  # fmt: skip
            logp[i], lse[i] = r.logp[0], r.lse[0]
            rep = r.report
            if provenance is None:
                backend, provenance = rep["backend_id"], rep["provenance"]["string"]
            elif rep["provenance"]["string"] != provenance:
                sys.exit(f"l3_rollout: one side served by two backends: {provenance} and {rep['provenance']['string']}")
            if rep["fallback"]:
                fallback = rep["fallback_reason"] or "yes"
            calls += 1
        out[case + "/logp"], out[case + "/lse"] = logp, lse
        meta[case + "/inputs_sha256"] = m["inputs_sha256"]
        meta[case + "/weight_fingerprint"] = m["weight_fingerprint"]
        print(f"  {case}: N={n} one row at a time, serving entry (Python binding)")
    meta.update(
        format="detlogp-l3-v1", side="rollout", producer="detlogp-python", pid=str(os.getpid()),
        backend=backend, provenance=provenance, calls=str(calls), fallback=fallback,
    )  # fmt: skip
    write_safetensors(args.out, out, meta)
    print(f"side rollout (Python): {calls} calls, backend {backend}, fallback {fallback}, pid {os.getpid()}")
    print(f"wrote: {args.out}")


if __name__ == "__main__":
    main()
