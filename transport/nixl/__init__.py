"""NIXL backend (UCX: cross-memory attach, cuda_ipc/NVLink, RDMA, TCP)."""
