"""onebitlamb compare's table: the bound on the whole run's reduction follows the warm-up's wire format."""
import pytest

from onebitlamb.train.compare import comparison, format_table


def _run(freeze, warmup_dtype, nbytes):
    return {"final_eval_loss": 4.0, "bytes_sent_per_rank": nbytes, "freeze_step": freeze, "steps": 400, "samples": 800,
            "rounds_per_rank": 10, "wall_time_s": 1.0, "samples_per_s": 1.0, "world_size": 4,
            "config": {"warmup_dtype": warmup_dtype}}


@pytest.mark.parametrize("dtype,bytes_an_element", [("float32", 4), ("bfloat16", 2), ("int8", 1 + 4 / 256)])
def test_the_ideal_reduction_prices_the_warmup_in_its_own_format(dtype, bytes_an_element):
    runs = {"lamb": _run(None, "float32", 1000), "onebitlamb": _run(100, dtype, 100)}
    ideal = comparison(runs)["onebitlamb"]["ideal_volume_reduction_fp32"]
    w, r = 100 / 400, bytes_an_element / 4
    assert ideal == pytest.approx(1 / (w * r + (1 - w) / 32))
    assert f"= {ideal:.2f}x" in format_table(runs)
