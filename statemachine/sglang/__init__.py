"""SGLang's own ZMQ wire, one subpackage per SGLang release.

Each ``vX_Y_Z`` folder holds every layout one SGLang release speaks between decode and prefill:
the decode's frame builders as :class:`~statemachine.backend.KVBackend` implementations (one
per SGLang transfer backend) and the parsing of what that release's prefill sends back. The next
release is a new folder next to this one, so the difference between two releases is one
``diff -r``. The rules, frame by frame, with SGLang file:line citations, are in
``spec/sglang-wire.md``.
"""
