"""Writes tests/tiling/data/old_defaults.json: the default plans of the planner as it stood
before the curated plan tables (commit 61daee7), which tests/tiling/test_curated_plans.py holds
the tables to.

Run once, from a checkout of that commit (the planner it describes is gone after it):
    git worktree add /tmp/old 61daee7 && cd /tmp/old && python <this file> > old_defaults.json
"""
import json
import sys

sys.path.insert(0, ".")
from cuflash import tiling  # noqa: E402

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90")
SIMT = tiling.SIMT_HEAD_DIM_CLASSES
TC = tuple(range(16, 257, 16))
ALL = ("float16", "bfloat16", "float32", "float64")
KERNELS = {  # planned kernel: dtypes, head dims (d == dv)
    "flash_fwd": (ALL, SIMT), "flash_fwd_masked": (ALL, SIMT),
    "flash_bwd_dkdv": (ALL, SIMT), "flash_bwd_dkdv_masked": (ALL, SIMT),
    "flash_fwd_tc": (("float16", "bfloat16"), TC), "flash_fwd_tc_masked": (("float16", "bfloat16"), TC),
    "flash_fwd_tf32": (("float32",), TC), "flash_fwd_tf32_masked": (("float32",), TC),
    "flash_bwd_tc": (("float16", "bfloat16"), TC), "flash_bwd_tc_masked": (("float16", "bfloat16"), TC),
    "flash_bwd_tf32": (("float32",), (32, 64, 96, 128)),
    "flash_bwd_tf32_masked": (("float32",), (32, 64, 96, 128)),
}
DISPATCH_DIMS = (8, 15, 16, 24, 32, 48, 64, 80, 96, 100, 112, 128, 160, 192, 200, 224, 256)


def row(p):
    return [p.kernel, p.block_q, p.block_kv, p.threads, p.shared_bytes, p.kd, p.kdv]


def main():
    plans, dispatch, serving = {}, {}, {}
    for kernel, (dtypes, dims) in KERNELS.items():
        for dt in dtypes:
            for d in dims:
                for arch in ARCHS:
                    try:
                        p = tiling.plan(kernel, d, d, dt, limit=tiling.EMULATOR_ARCHES[arch])
                    except ValueError:
                        continue
                    plans.setdefault(f"{kernel} {dt} {d}", {})[arch] = row(p)[1:]
    for dt in ALL:
        for d in DISPATCH_DIMS:
            for arch in ("sm_80", "sm_90"):
                lim = tiling.EMULATOR_ARCHES[arch]
                for masked in (False, True):
                    for what, fn in (("fwd", tiling.plan_flash_fwd), ("bwd", tiling.plan_flash_bwd),
                                     ("bwd_tf32", tiling.plan_bwd_tf32)):
                        try:
                            p = fn(d, d, dt, limit=lim, masked=masked)
                        except ValueError:
                            continue
                        if p is not None:
                            key = f"{what}{'_masked' if masked else ''} {dt} {d}"
                            dispatch.setdefault(key, {})[arch] = row(p)[:3] + row(p)[5:]
    from cuflash import kernels
    from cuflash._launch_serving import serving_plan
    for arch in ("sm_80", "sm_90"):
        rt = kernels.get_runtime("emulator", arch=arch)
        for kernel in ("flash_fwd", "flash_fwd_masked"):
            for dt in ALL:
                for d in SIMT:
                    for rows in (1, 9, 17, 33, 65, 4096):
                        try:
                            p = serving_plan(rt, d, d, dt, rows, kernel=kernel)
                        except ValueError:
                            continue
                        serving.setdefault(f"{kernel} {dt} {d} {arch}", {})[rows] = [p.block_q, p.block_kv]
    doc = {"commit": "61daee7", "fields": {
           "plans": "kernel dtype d (d == dv) -> arch -> [block_q, block_kv, threads, "
                    "shared_bytes, kd, kdv]",
           "dispatch": "plan_flash_fwd/_bwd/plan_bwd_tf32 (masked) dtype d -> arch -> "
                       "[kernel, block_q, block_kv, kd, kdv]",
           "serving": "_launch_serving.serving_plan kernel dtype d arch -> rows -> "
                      "[block_q, block_kv]"}}
    out = ["{"] + [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in doc.items()]
    data = {"plans": plans, "dispatch": dispatch, "serving": serving}
    for i, (name, section) in enumerate(data.items()):
        out.append(f"{json.dumps(name)}: {{")
        out += [f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}," for k, v in section.items()]
        out[-1] = out[-1].rstrip(",")
        out.append("}," if i + 1 < len(data) else "}")
    out.append("}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
