"""torch_npu implementations, one module per area.

Each function calls a fused torch_npu op with the argument names of its documentation
page (Ascend/op-plugin ``docs/context/torch_npu-<name>.md``) and adapts layouts and dtypes
to what that page allows. Each module also has ``*_problem`` functions naming what the op
cannot take (a dtype, a size), which the dispatcher uses to skip or refuse the backend.
Inputs reach these functions non-empty: torch_npu's fused ops reject empty tensors, and
the public ops answer empty inputs themselves.
"""
