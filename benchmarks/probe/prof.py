import sys, torch
import vlseq_ext.nn as vnn
torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
which = sys.argv[1]
H, B, T, layers = {"local": (64, 32, 480, 1), "cluster": (256, 1, 480, 1), "grid": (1024, 32, 100, 1)}[which]
m = vnn.LSTM(36, H, num_layers=layers, batch_first=True).cuda()
x = torch.randn(B, T, 36, device="cuda")
for _ in range(2):
    out, _ = m(x)
    out.sum().backward()
torch.cuda.synchronize()
