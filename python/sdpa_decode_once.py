# One SDPA decode call (after warm-up) between cudaProfilerStart/Stop, for ncu
# --profile-from-start off (bench/run_gpu_dram_pattern.sh). Usage: L B cudnn|flash|efficient
import sys, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
L, B, be = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
bk = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[be]
q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16)
with sdpa_kernel([bk]):
    for _ in range(3): F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
