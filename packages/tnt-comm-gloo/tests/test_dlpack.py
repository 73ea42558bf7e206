"""DLPack buffers: host tensors in place, CUDA tensors staged through pinned memory.

No GPU is needed: a fake CUDA runtime (cudaMemcpy = memcpy), built here with the C
compiler and loaded through ``TNT_GLOO_CUDART``, drives the staging code end to end on
host memory that claims to be a CUDA device. A real GPU is not exercised by this test.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_CUDART = r"""
#include <stdlib.h>
#include <string.h>
int fake_d2h = 0, fake_h2d = 0, fake_device = -1, fake_pinned_allocs = 0, fake_syncs = 0;
int cudaSetDevice(int device) { fake_device = device; return 0; }
int cudaStreamSynchronize(void* stream) { fake_syncs += stream == 0; return 0; }
int cudaMallocHost(void** ptr, size_t n) {
  *ptr = malloc(n); fake_pinned_allocs++; return *ptr ? 0 : 2; }
int cudaFreeHost(void* ptr) { free(ptr); return 0; }
int cudaMemcpy(void* dst, const void* src, size_t n, int kind) {
  memcpy(dst, src, n);
  if (kind == 2) fake_d2h++; else if (kind == 1) fake_h2d++; else return 1;
  return 0; }
const char* cudaGetErrorString(int status) { return "fake CUDA error"; }
"""


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler to build the fake CUDA runtime")
    directory = tmp_path_factory.mktemp("fake-cudart")
    source, library = directory / "fake_cudart.c", directory / "libfakecudart.so"
    source.write_text(FAKE_CUDART)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_dlpack_dispatch_and_staging(scenario, fake_cudart: Path) -> None:
    scenario("dlpack", 2, args=["--fake-cudart", str(fake_cudart)]).assert_ok(2)
