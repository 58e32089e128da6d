"""deft under the trainers people use: each module is one trainer's one-line switch.

* :mod:`deft.integrations.accelerate`: ``Accelerator`` (Accelerate's, building deft's wrapper where
  Accelerate builds torch DDP);
* :mod:`deft.integrations.lightning`: ``Trainer(strategy="deft")`` (a ``DDPStrategy`` registered with
  Lightning's ``StrategyRegistry``);
* :mod:`deft.integrations.transformers`: the HuggingFace ``Trainer`` through the Accelerate integration.

Each trainer is an optional extra (``pip install deft[accelerate]``, ``deft[lightning]``,
``deft[transformers]``); importing a module without its trainer installed raises ``ImportError``
naming the extra. Nothing here changes what deft computes: the runtime (:mod:`deft.runtime`) is the
same under every trainer, and these modules only place the wrapper where the trainer places torch DDP.
"""
