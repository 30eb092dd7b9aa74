"""Benchmark: the extra peak memory of the real-loss sampling step, CPU, vocabulary 50,257.

One process per measurement: a Hugging Face GPT-2 built from a config (d 64, 2 layers, 4 heads, eager attention,
L 128, vocabulary 50,257, float32), two plain training steps, then one measured step: ``plain`` (forward + backward),
``capture`` (inside a :class:`~curvwatch.capture.Capture` without sampling) or ``sample`` (with the logits module and
:meth:`~curvwatch.capture.Capture.sample_outputs` of 16 samples before the backward). It prints the peak RSS of the
measured step over the peak of the two plain steps. Run it with ``MALLOC_MMAP_THRESHOLD_=65536``: a fixed threshold
makes glibc map every large buffer on its own and unmap it when freed, so the RSS peak is the peak of live buffers
(glibc's default threshold grows with freed buffers and keeps them, which made earlier RSS readings noisy by hundreds
of MiB). The times it prints are inflated by that setting (every large buffer is mapped anew); use
``bench_sharpness --cost`` for times.

Run: ``MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python -m benchmarks.bench_real_loss_memory sample 8 [512]``
(mode, batch, max_tokens).
"""

from __future__ import annotations

import resource
import sys
import time

import torch
import torch.nn.functional as F

from curvwatch.realloss import sample_outputs


def main(argv: list[str] | None = None) -> float:
    import transformers as tf

    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture

    args = sys.argv[1:] if argv is None else argv
    mode, B = args[0], int(args[1])
    max_tokens = int(args[2]) if len(args) > 2 else 512
    torch.set_num_threads(1)
    V, L = 50_257, 128
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=V, n_positions=L, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)  # fmt: skip
    cfg._attn_implementation = "eager"
    model = tf.GPT2LMHeadModel(cfg)
    x = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))

    def loss_of_step():
        return F.cross_entropy(model(x).logits.reshape(-1, V), x.reshape(-1))  # the logits are not held

    for _ in range(2):
        loss_of_step().backward()
        model.zero_grad()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "plain":
        loss_of_step().backward()
    else:
        head = model.lm_head if mode == "sample" else None
        with Capture(find_blocks(model), max_tokens=max_tokens, logits_module=head) as cap:
            loss = loss_of_step()
            if mode == "sample":
                sample_outputs(cap, loss, 16, generator=torch.Generator().manual_seed(0))
            loss.backward()
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(f"{mode} B={B} max_tokens={max_tokens}: peak RSS +{extra:.0f} MiB over two plain steps' peak "
          f"({base / 1024:.0f} MiB), {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return extra


if __name__ == "__main__":
    main()
