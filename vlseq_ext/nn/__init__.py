"""Recurrent layers on the persistent kernels: drop-in nn.LSTM / nn.GRU with per-sample lengths."""
from .functional import rnn
from .modules import GRU, KERNEL_CHOICES, LSTM, VlseqFallbackWarning, use_kernels

__all__ = ["LSTM", "GRU", "rnn", "use_kernels", "KERNEL_CHOICES", "VlseqFallbackWarning"]
