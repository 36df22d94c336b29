"""The base images of the accelerator targets, pinned by digest (the CPU base is built here from
images/cpu/packages.lock). A build reads them from images/base-cache/, filled on a machine with
registry access by the command that a build without the cache prints:

  skopeo copy --override-os linux --override-arch amd64 \\
      docker://REF@DIGEST oci-archive:images/base-cache/DIGEST.tar   (":" in DIGEST as "-")

skopeo checks the pulled manifest against the digest.

Why python:3.12-bookworm for both: PyPI's CUDA torch (and PyTorch's ROCm torch) wheels carry
their accelerator's user-space libraries themselves; the driver comes from the host (NVIDIA's
container toolkit, or /dev/kfd and /dev/dri for ROCm). What the base must bring is CPython 3.12
(the GPU machines' Python) and, for Triton, which compiles its launchers at run time, a C compiler
and Python's headers: this image has all three; nvidia/cuda and rocm/dev images have no Python.

NOTE: this digest was taken from public pins of python:3.12-bookworm; it could not be checked
from the machine that wrote this file (no registry access there). The cache command verifies it.
"""

BASES = {
    "cuda": struct(
        ref = "docker.io/library/python",
        digest = "sha256:9bed8554e926c07c6f908841d5ee88c33e8df9236b191526bbce81a9062ab43a",
    ),
    "rocm": struct(
        ref = "docker.io/library/python",
        digest = "sha256:9bed8554e926c07c6f908841d5ee88c33e8df9236b191526bbce81a9062ab43a",
    ),
}
