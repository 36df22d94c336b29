"""Mooncake Transfer Engine backend (TCP, or RDMA where the host has an RDMA NIC)."""
