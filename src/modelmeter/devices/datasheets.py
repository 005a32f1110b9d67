"""The built-in accelerators, one block per device, as their datasheets state them (docs/devices.md).

Every peak is dense: a datasheet figure marked "with sparsity" (2:4 structured sparsity) is halved here, written
as ``figure / 2`` so the datasheet's own number stays visible. Rates in FLOP/s (int8 in OP/s), bandwidth in
bytes/s and memory in bytes, both decimal as the datasheets give them (``80GB`` is 80e9 bytes, ``3.35TB/s`` is
3.35e12 bytes/s). ``notes`` says which rule filled a number a document does not list.
"""

from __future__ import annotations

from .device import Device

G = 10**9  # GB, GB/s (a whole number: memory is in whole bytes)

_HALF_AS_FP32 = ("no document lists a non-tensor fp16/bf16 rate: the fp32 vector rate is used (PyTorch computes "
                 "element-wise half-precision math in float32)")

A100 = Device(
    name="a100", label="NVIDIA A100 SXM4 80GB",
    memory=80 * G, bandwidth=2039 * G,
    matrix={"fp64": 19.5e12, "tf32": 312e12 / 2, "bf16": 624e12 / 2, "fp16": 624e12 / 2,
            "int8": 1248e12 / 2},
    vector={"fp64": 9.7e12, "fp32": 19.5e12, "fp16": 78e12, "bf16": 39e12},
    aliases=("a100-sxm4-80gb", "a100-sxm4", "a100-sxm", "a100-80gb"),
    source="NVIDIA A100 Tensor Core GPU datasheet "
           "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
           "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), A100 80GB SXM column; "
           "NVIDIA A100 Tensor Core GPU Architecture whitepaper, Table 1, for the non-tensor fp16 and bf16 rates "
           "(https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf)",
    notes="no fp8 tensor cores: fp8 matrix work runs at the fp16 rate",
)

H100 = Device(
    name="h100", label="NVIDIA H100 SXM5 80GB",
    memory=80 * G, bandwidth=3.35e12,
    matrix={"fp64": 67e12, "tf32": 989e12 / 2, "bf16": 1979e12 / 2, "fp16": 1979e12 / 2,
            "fp8": 3958e12 / 2, "int8": 3958e12 / 2},
    vector={"fp64": 34e12, "fp32": 67e12, "fp16": 133.8e12, "bf16": 133.8e12},
    aliases=("h100-sxm5-80gb", "h100-sxm5", "h100-sxm", "h100-sxm-80gb"),
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
           "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet); "
           "NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 3, for the non-tensor fp16 and bf16 rates "
           "(https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper)",
)

H100_PCIE = Device(
    name="h100-pcie", label="NVIDIA H100 PCIe 80GB",
    memory=80 * G, bandwidth=2.0e12,
    matrix={"fp64": 51e12, "tf32": 756e12 / 2, "bf16": 1513e12 / 2, "fp16": 1513e12 / 2,
            "fp8": 3026e12 / 2, "int8": 3026e12 / 2},
    vector={"fp64": 26e12, "fp32": 51e12, "fp16": 2 * 51e12, "bf16": 2 * 51e12},
    aliases=("h100-pcie-80gb", "h100pcie"),
    source="NVIDIA H100 Tensor Core GPU datasheet (2022 edition), H100 PCIe column "
           "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)",
    notes="non-tensor fp16/bf16: twice the fp32 rate, Hopper's ratio (the H100 whitepaper's Table 3 gives "
          "133.8 against 66.9 TFLOPS for the SXM5)",
)

H200 = Device(
    name="h200", label="NVIDIA H200 SXM 141GB",
    memory=141 * G, bandwidth=4.8e12,
    matrix={"fp64": 67e12, "tf32": 989e12 / 2, "bf16": 1979e12 / 2, "fp16": 1979e12 / 2,
            "fp8": 3958e12 / 2, "int8": 3958e12 / 2},
    vector={"fp64": 34e12, "fp32": 67e12, "fp16": 133.8e12, "bf16": 133.8e12},
    aliases=("h200-sxm", "h200-sxm-141gb", "h200-141gb"),
    source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
           "(https://www.nvidia.com/en-us/data-center/h200/); NVIDIA H100 Tensor Core GPU Architecture "
           "whitepaper, Table 3 (https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper)",
    notes="non-tensor fp16/bf16: the H100 SXM5's (the whitepaper's Table 3): the H200 is the same GH100 at the "
          "same datasheet rates, with more and faster memory",
)

B200 = Device(
    name="b200", label="NVIDIA B200 (HGX) 180GB",
    memory=180 * G, bandwidth=7.7e12,
    matrix={"fp64": 37e12, "tf32": 2200e12 / 2, "bf16": 4500e12 / 2, "fp16": 4500e12 / 2,
            "fp8": 9000e12 / 2, "fp4": 18000e12 / 2, "int8": 9000e12 / 2},
    vector={"fp64": 37e12, "fp32": 75e12},
    aliases=("b200-sxm", "hgx-b200", "b200-180gb"),
    source="NVIDIA HGX platform specifications, HGX B200, per GPU (https://www.nvidia.com/en-us/data-center/hgx/)",
    notes=f"{_HALF_AS_FP32}; the tensor-core figures are listed with sparsity (halved here)",
)

L4 = Device(
    name="l4", label="NVIDIA L4 24GB",
    memory=24 * G, bandwidth=300 * G,
    matrix={"tf32": 120e12 / 2, "bf16": 242e12 / 2, "fp16": 242e12 / 2, "fp8": 485e12 / 2,
            "int8": 485e12 / 2},
    vector={"fp64": 30.3e12 / 64, "fp32": 30.3e12},
    aliases=("l4-24gb", "nvidia-l4"),
    source="NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/, "
           "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet); NVIDIA Ada GPU "
           "Architecture whitepaper for the fp64 ratio "
           "(https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf)",
    notes=f"{_HALF_AS_FP32}; no fp64 on the datasheet and no fp64 tensor cores: fp64 at 1/64 of the fp32 rate, "
          "Ada's ratio (2 fp64 units per SM beside 128 fp32 ones)",
)

MI300X = Device(
    name="mi300x", label="AMD Instinct MI300X 192GB",
    memory=192 * G, bandwidth=5.3e12,
    matrix={"fp64": 163.4e12, "fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12,
            "fp8": 2614.9e12, "int8": 2614.9e12},
    vector={"fp64": 81.7e12, "fp32": 163.4e12},
    aliases=("amd-mi300x", "instinct-mi300x", "mi300x-192gb"),
    source="AMD Instinct MI300X accelerator data sheet "
           "(https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
           "amd-instinct-mi300x-data-sheet.pdf); AMD Instinct MI300 series microarchitecture, table "
           "'Peak-performance capabilities of the MI300X' (https://rocm.docs.amd.com/en/latest/conceptual/"
           "gpu-arch/mi300.html), dense figures",
    notes=f"{_HALF_AS_FP32}; fp32 matrix work runs on the matrix cores at 163.4 TFLOPS (fp32 is a matrix "
          "format on CDNA 3)",
)

BUILT_IN = (A100, H100, H100_PCIE, H200, B200, L4, MI300X)
