"""What runs while the model trains: the chunk stores (host masters, device chunk buffers, gradient
copies), the swap copies, the host worker, the hybrid CPU/device optimizer, the custom ops the
compiled graphs call, and the binding of a compiled graph to the parameters it is called with. Never
imports torch.fx.
"""
