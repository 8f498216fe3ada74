#!/usr/bin/env python3
"""Writes tests/fixtures/hostile/: small snapshot pickles (and JSON Lines traces) that are
inconsistent or absurd in one way each, for tests/hostile.rs. Plain pickle, no torch:

    python3 tools/hostile_fixtures.py

Each file is a copy of one consistent run (`base`, which validates exact) with one thing broken.
"""
import copy
import os
import pickle

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hostile")
MiB = 1 << 20
A = 0x7F0000000000  # the segment's address
B = A + 0x40000000  # a second segment's address


def entry(action, addr, size):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0,
         "compile_context": "N/A", "user_metadata": ""}
    if action == "oom":
        del e["addr"]
        e["device_free"] = addr
    return e


def block(addr, size, state):
    return {"address": addr, "size": size, "requested_size": size if state != "inactive" else 0,
            "state": state, "frames": []}


def segment(addr, size, blocks, device=0):
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": addr, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks}


def base():
    """A 20 MiB segment; 8 MiB and 4 MiB allocated in it, the 8 MiB freed."""
    trace = [
        entry("segment_alloc", A, 20 * MiB),
        entry("alloc", A, 8 * MiB),
        entry("alloc", A + 8 * MiB, 4 * MiB),
        entry("free_requested", A, 8 * MiB),
        entry("free_completed", A, 8 * MiB),
    ]
    seg = segment(A, 20 * MiB, [block(A, 8 * MiB, "inactive"), block(A + 8 * MiB, 4 * MiB, "active_allocated"),
                                block(A + 12 * MiB, 8 * MiB, "inactive")])
    return {"segments": [seg], "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}, "external_annotations": []}


def write(name, obj):
    with open(os.path.join(OUT, name), "wb") as f:
        pickle.dump(obj, f, protocol=4)


def main():
    os.makedirs(OUT, exist_ok=True)
    write("base.pickle", base())

    # Final segments on absurd devices (PyTorch's device indices are small ints).
    for name, dev in [("device_2p32", 1 << 32), ("device_2p24", 1 << 24), ("device_negative", -1)]:
        s = base()
        extra = copy.deepcopy(s["segments"][0])
        extra["device"] = dev
        extra["address"] = B
        for b in extra["blocks"]:
            b["address"] += B - A
        s["segments"].append(extra)
        write(f"{name}.pickle", s)
        # The same with no trace entries anywhere: the device is chosen by the segments alone.
        s["device_traces"] = []
        write(f"{name}_no_trace.pickle", s)

    # A free_completed recorded twice.
    s = base()
    s["device_traces"][0].append(entry("free_completed", A, 8 * MiB))
    write("dup_free_completed.pickle", s)

    # A free of an address the trace never allocated, after the trace began with an empty
    # allocator (it allocates its first segment itself).
    s = base()
    s["device_traces"][0] += [entry("free_requested", A + 16 * MiB, 2 * MiB), entry("free_completed", A + 16 * MiB, 2 * MiB)]
    write("free_never_allocated.pickle", s)

    # Nothing at all.
    write("empty_list.pickle", [])
    write("empty_snapshot.pickle", {"segments": [], "device_traces": []})

    # Two final segments that overlap.
    s = base()
    s["segments"].append(segment(A + 4 * MiB, 20 * MiB, [block(A + 4 * MiB, 20 * MiB, "inactive")]))
    write("overlapping_segments.pickle", s)

    # The same final segment twice.
    s = base()
    s["segments"].append(copy.deepcopy(s["segments"][0]))
    write("dup_final_segment.pickle", s)

    # A final segment of 2^63 bytes.
    s = base()
    s["segments"].append(segment(B, 1 << 63, [block(B, 1 << 63, "inactive")]))
    write("huge_final_segment.pickle", s)

    # An allocation overlapping one still live.
    s = base()
    s["device_traces"][0].insert(3, entry("alloc", A + 10 * MiB, 4 * MiB))
    write("overlapping_allocs.pickle", s)

    # Not a snapshot, with a key whose text holds a newline (the error must stay one line).
    write("newline_key.pickle", {"segments": [], "bad\nkey": 1})

    # JSON Lines with only its header.
    with open(os.path.join(OUT, "header_only.jsonl"), "w") as f:
        f.write('{"format":"allocsim-trace","version":1}\n')


if __name__ == "__main__":
    main()
