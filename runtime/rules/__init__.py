"""The optimizer math: Muon, Shampoo, SOAP and AdamW per tensor, fp32 main copies of low-precision
parameters, and the sharded Newton–Schulz of cooperatively hosted matrices."""
