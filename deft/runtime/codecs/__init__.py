"""Which codec sends which bucket: deft's codec choice and the comm hooks that run it.

One job per module; the course asks :class:`~deft.runtime.codecs.policy.CodecPolicy` alone:

* ``policy``: the one object the course asks, at the run's named moments, and the hook tables it gives
  the executor;
* ``first_iteration``: the first iteration's sends (screened, speculated, judged on a sample) and the
  profile iterations' codec;
* ``choice``: the plan's choice (measured inputs, rank 0's decision, the coded profile) and its making
  again on calibration;
* ``timing``: a codec timed on the profile's buckets, agreed over the ranks;
* ``wire``: the bytes each codec puts on the wire;
* ``hooks``: torch's comm-hook adapter on deft's buckets and links;
* ``powersgd_memory``: PowerSGD's per-bucket memory carried across bucket layouts;
* ``int8``: deft's 8-bit codec as a torch comm hook (public as ``deft.runtime.int8_hook``).

This package imports none of its modules, so the executor may import ``hooks`` alone.
"""
