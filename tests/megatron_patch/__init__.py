"""Tests of the heterogeneous training runtime (megatron_patch)."""
