"""Discovery of prefill ranks through etcd (docs/etcd.md): the key layout, a small client for
etcd's JSON gateway, the prefill-side registrar and the decode-side bootstrap source."""
