"""Fixtures of the integration tests whose definitions live in tests/support/ (several test files
use each)."""

from __future__ import annotations

from tests.support.etcd_cluster_support import cluster, etcd
from tests.support.manager_support import slow_prefill
from tests.support.receiver_support import prefill

__all__ = ["cluster", "etcd", "prefill", "slow_prefill"]  # fixtures, for pytest
