"""DistributedDataParallel built from scratch, in one screen: the group's rank 0's parameters and buffers
broadcast at wrap (torch's DDP also re-broadcasts rank 0's buffers before a forward, unless the previous one ran
without gradients or inside no_sync: notebook ddp_under_the_hood §3.5; this does not); buckets in
reverse registration order; one asynchronous all-reduce per bucket, launched the moment its last gradient is
ready; every bucket waited for and copied back at the end of backward(); no_sync for gradient accumulation,
read at forward time, as torch's is."""
import contextlib

import torch
import torch.distributed as dist
from torch import nn


class MyDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0, group=None):
        super().__init__()
        self.module, self.group, self.world_size = module, group, dist.get_world_size(group)
        # 1. Every rank starts from the parameters and buffers of the group's rank 0 (group_src counts ranks in
        #    `group`; src would count global ranks). detach(): the broadcast writes data, outside autograd.
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), group_src=0, group=group)
        # 2. Buckets: the parameters in reverse order of registration (backward produces the last layer's
        #    gradients first); a bucket closes once it holds at least bucket_cap_mb MB. A tensor is never split.
        parameters = [p for p in module.parameters() if p.requires_grad]
        self.buckets, bucket, size = [], [], 0
        for p in reversed(parameters):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_mb * 2**20:
                self.buckets.append(bucket)
                bucket, size = [], 0
        self.buckets += [bucket] if bucket else []
        self.bucket_of = {p: index for index, bucket in enumerate(self.buckets) for p in bucket}
        # 3. A hook per parameter: autograd calls it once the parameter's .grad holds this backward's gradient.
        for p in parameters:
            p.register_post_accumulate_grad_hook(self._gradient_ready)
        self.sync, self.sync_backward = True, False
        self.ready, self.launched, self.waiting = [0] * len(self.buckets), [], False

    def forward(self, *inputs, **kwargs):
        # As in torch's DDP, the forward decides whether the backward that follows it syncs: no_sync must
        # include the forward.
        self.sync_backward = self.sync and torch.is_grad_enabled()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards inside: their backward passes only accumulate .grad locally. Nested: restores the outer."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _gradient_ready(self, p):
        if not self.sync_backward:
            return
        if not self.waiting:  # the first gradient of this backward: wait for every bucket once backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.waiting = True
        self.ready[self.bucket_of[p]] += 1
        # 4. Launch, in bucket order (every rank must issue its collectives in the same order), each bucket
        #    whose gradients are all in: flattened, times 1/world size (as DDP does), then summed across ranks.
        while len(self.launched) < len(self.buckets) and \
                self.ready[len(self.launched)] == len(bucket := self.buckets[len(self.launched)]):
            flat = torch.cat([q.grad.reshape(-1) for q in bucket]).mul_(1 / self.world_size)
            self.launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))

    def _finish(self):
        """End of backward: wait for each bucket's all-reduce and copy the averaged gradients into .grad."""
        for work, flat, bucket in self.launched:
            work.wait()
            for q, averaged in zip(bucket, flat.split([q.numel() for q in bucket]), strict=True):
                q.grad.copy_(averaged.view_as(q))
        complete = len(self.launched) == len(self.buckets)
        self.ready, self.launched, self.waiting, self.sync_backward = [0] * len(self.buckets), [], False, False
        if not complete:
            raise RuntimeError("a bucket never completed: some parameter got no gradient in this backward on "
                               "this rank, so its all-reduce was never launched here (the other ranks wait for it)")
