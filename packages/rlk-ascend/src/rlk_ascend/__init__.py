"""rlk_ascend: backend "ascend" on Huawei Ascend NPUs through torch-npu.

torch_npu is imported only when this backend is loaded; without Huawei's CANN, importing it can
break ``import torch`` itself, so it is never a dependency that pip installs for you.
"""
