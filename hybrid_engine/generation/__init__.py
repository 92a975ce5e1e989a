"""Host plumbing both front ends share: the slot scheduler, the call context, timing, token ids, and
transformers' ``generate`` contract (:mod:`.generate`)."""
