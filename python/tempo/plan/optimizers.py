"""The optimizers tempo.plan plans, as each allocates on the device and moves memory in its step,
run on the plan's fake tensors:

  adamw          torch's fused AdamW (fused=True; HF Trainer's default since torch 2.8): on its
                 first step exp_avg and exp_avg_sq (float32 for every weight, as the plan's
                 precisions state) and a float32 step count on the device per parameter; no
                 temporary after that, one pass over weights, gradients and state per step
  adamw-foreach  torch.optim.AdamW(params) as it runs on a GPU by default (foreach): state in the
                 weights' dtype, the step counts on the host, and per dtype group the temporary
                 sqrt(exp_avg_sq) of every parameter at once; its for-each operators run here on
                 the fake tensors as torch's _multi_tensor_adam runs them (traffic counted)
  adamw8bit      bitsandbytes' blockwise 8-bit AdamW: one byte a moment per element, a float32
                 absolute maximum per block of 256 and two 256-entry quantisation maps; float32
                 moments for tensors under 4,096 elements; one fused pass a step
  sgd            plain SGD (no momentum: no state), one pass
"""

import torch


class PlannedOptimizer:
    """An optimizer over `params` of the given kind (the module's docstring). `traffic` is the
    bytes its fused kernels moved in its last step (the for-each operators' are counted by the
    trace's traffic count, as they run)."""

    def __init__(self, params, kind, device_kind="cuda"):
        self.params = [p for p in params if p.requires_grad]
        self.kind = kind
        self.device_kind = device_kind
        self.state = {}
        self.steps = 0
        self.traffic = 0
        self.traffic_by_tag = {}
        self.tag_for = lambda p: None  # engine.train tags each parameter's work with its layer

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            self.tag_for(p)
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.steps += 1
        if not self.state and self.kind != "sgd":
            self._make_state()
        if self.kind == "adamw-foreach":
            self._foreach_step()
            return
        from .engine import CURRENT

        self.traffic, self.traffic_by_tag = 0, {}
        for p in self.params:
            self.tag_for(p)
            weights = p.numel() * p.element_size()
            moved = 3 * weights  # the weights read and written, the gradient read
            moved += sum(2 * t.numel() * t.element_size() for t in self.state.get(p, ()) if t.dim())
            self.traffic += moved
            self.traffic_by_tag[CURRENT["tag"]] = self.traffic_by_tag.get(CURRENT["tag"], 0) + moved

    def _make_state(self):
        if self.kind == "adamw8bit":
            self.state["qmap"] = [torch.zeros(256), torch.zeros(256)]
        for p in self.params:
            self.tag_for(p)
            if self.kind == "adamw":
                self.state[p] = (
                    torch.zeros((), dtype=torch.float32),
                    torch.zeros(p.shape, dtype=torch.float32),
                    torch.zeros(p.shape, dtype=torch.float32),
                )
            elif self.kind == "adamw-foreach":
                steps = (torch.zeros((), dtype=torch.float32),) if self.device_kind == "cpu" else ()  # the host's
                self.state[p] = steps + (torch.zeros_like(p), torch.zeros_like(p))
            elif p.numel() < 4096:
                self.state[p] = (torch.zeros(p.shape, dtype=torch.float32), torch.zeros(p.shape, dtype=torch.float32))
            else:
                blocks = -(-p.numel() // 256)
                self.state[p] = (
                    torch.zeros(p.shape, dtype=torch.uint8),
                    torch.zeros(p.shape, dtype=torch.uint8),
                    torch.zeros(blocks, dtype=torch.float32),
                    torch.zeros(blocks, dtype=torch.float32),
                )

    def _foreach_step(self):
        """torch's _multi_tensor_adam (decoupled weight decay, not capturable, no amsgrad), its
        operators in its order, per (device, dtype) group in the order the groups first appear.
        Each for-each operator runs here tensor by tensor, tagged with its parameter's layer (the
        fake tensors' for-each kernels make and drop a copy of each tensor they update in place,
        which the device's do not); the in-place ones allocate nothing, the square roots one
        temporary a parameter, all alive until the group's update is done."""
        groups = {}
        for p in self.params:
            groups.setdefault(p.dtype, []).append(p)
        self.traffic, self.traffic_by_tag = 0, {}
        sqrt = None
        self._params_of_last = []
        for params in groups.values():
            if self.device_kind == "cpu":  # the step counts, on the host: a CPU plan counts them
                torch._foreach_add_([self.state[p][0] for p in params], torch.tensor(1.0), alpha=1.0)
            for p in params:  # weight decay, lerp, mul, addcmul: in place
                self.tag_for(p)
                exp_avg, exp_avg_sq = self.state[p][-2:]
                p.mul_(1 - 1e-3 * 1e-2)
                exp_avg.lerp_(p.grad, 0.1)
                exp_avg_sq.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
            step_size = -1e-3 / (1 - 0.9**self.steps)
            bias_correction2_sqrt = (1 - 0.999**self.steps) ** 0.5
            last, sqrt = sqrt, []  # the last group's freed only after this one's are made, as in torch
            for p in params:
                self.tag_for(p)
                sqrt.append(self.state[p][-1].sqrt())
            self._release(last)
            if self.device_kind == "cpu":  # the CPU's for-each loops wrap each scalar in tensors
                wrapped = (torch.empty((), dtype=torch.float64), torch.empty((), dtype=torch.float32))
                del wrapped
            for p, root in zip(params, sqrt):  # div, add, addcdiv: in place
                self.tag_for(p)
                root.div_(bias_correction2_sqrt).add_(1e-8)
                p.addcdiv_(self.state[p][-2], root, value=step_size)
            self._params_of_last = params
        self._release(sqrt)

    def _release(self, temporaries):
        """Frees a group's temporaries one by one, each tagged with its parameter's layer."""
        if temporaries is None:
            return
        for i, p in enumerate(self._params_of_last[: len(temporaries)]):
            self.tag_for(p)
            temporaries[i] = None
