"""Server-side optimizers, with MXNet 1.9.1's names, parameters and arithmetic.

``kv.set_optimizer(psnet.optimizer.SGD(learning_rate=0.1, momentum=0.9))`` or, by name,
``kv.set_optimizer('sgd', learning_rate=0.1)``. The servers (or, for the ``local`` store,
this process) apply them to each key's value when its gradients arrive.
"""

import json
import warnings

# MXNet's optimizer arguments that change nothing on psnet's servers for dense keys:
# lazy_update acts on row-sparse pushes only (psnet's servers update lazily, MXNet's default;
# a store whose optimizer says lazy_update=False refuses row pushes); multi_precision=True is what psnet's servers
# always do (a float32 master copy of every float16 / bfloat16 key).
_ACCEPTED = ("multi_precision", "lazy_update")
# MXNet's arguments psnet's servers do not run: refused by name rather than ignored.
_UNSUPPORTED = {
    "lr_scheduler": "learning-rate schedules (set the optimizer again with the new rate)",
    "param_idx2name": "per-parameter names (psnet's servers see keys)",
    "param_dict": "per-parameter settings",
    "sym": "a symbol's attributes",
    "begin_num_update": "a starting update count",
}


def _check_mxnet_args(name, extra):
    """Takes MXNet's arguments that have psnet's meaning; anything else is a clear error."""
    for arg, value in extra.items():
        if arg in _ACCEPTED:
            if arg == "multi_precision" and not value:
                warnings.warn(
                    f"{name}: multi_precision=False: psnet's servers always update float16 "
                    "keys through a float32 master copy (MXNet's multi_precision=True); float32 "
                    "keys are unaffected", stacklevel=3)
            continue
        if arg in _UNSUPPORTED and extra[arg] is not None:
            raise ValueError(f"{name}: {arg} is not supported by psnet's servers: "
                             f"{_UNSUPPORTED[arg]}")
        if arg not in _UNSUPPORTED:
            raise ValueError(
                f"{name}: unknown argument {arg!r}; psnet takes its own parameters and MXNet's "
                f"{', '.join(_ACCEPTED)}")


class Optimizer:
    """An optimizer's type and hyper-parameters, as psnet's servers take them."""

    type = None

    def __init__(self, mxnet_args=None, **params):
        _check_mxnet_args(type(self).__name__, mxnet_args or {})
        # Row-sparse pushes are updated lazily (MXNet's default); False is refused there.
        self.lazy_update = bool((mxnet_args or {}).get("lazy_update", True))
        self.params = {k: v for k, v in params.items() if v is not None}

    def spec(self):
        """The JSON spec sent to the servers."""
        return json.dumps(dict(type=self.type, **self.params))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum and weight decay (MXNet's SGD)."""

    type = "sgd"

    def __init__(self, learning_rate=0.01, momentum=0.0, wd=0.0, rescale_grad=1.0,
                 clip_gradient=None, **mxnet_args):
        super().__init__(mxnet_args, learning_rate=learning_rate, momentum=momentum, wd=wd,
                         rescale_grad=rescale_grad, clip_gradient=clip_gradient)


class Adam(Optimizer):
    """Adam with MXNet's bias correction (MXNet's Adam)."""

    type = "adam"

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                 rescale_grad=1.0, clip_gradient=None, **mxnet_args):
        super().__init__(mxnet_args, learning_rate=learning_rate, beta1=beta1, beta2=beta2,
                         epsilon=epsilon, wd=wd, rescale_grad=rescale_grad,
                         clip_gradient=clip_gradient)


class Test(Optimizer):
    """MXNet's ``Test`` optimizer: ``weight += grad * rescale_grad``."""

    type = "test"

    def __init__(self, rescale_grad=1.0, **mxnet_args):
        super().__init__(mxnet_args, rescale_grad=rescale_grad)


_BY_NAME = {"sgd": SGD, "adam": Adam, "test": Test}


def create(name, **params):
    """An optimizer by its MXNet name (``'sgd'``, ``'adam'``, ``'test'``)."""
    try:
        cls = _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(
            f"optimizer {name!r} is not one psnet's servers run (sgd, adam, test)"
        ) from None
    return cls(**params)
