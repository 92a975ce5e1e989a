"""Decode-step device ops behind ``torch.library`` custom ops: one op (one node in a captured graph, one kernel
counted) whatever implementation runs it; the implementation is chosen by a capability probe, never by device
name, with a reference implementation in plain aten ops that every backend can run."""
