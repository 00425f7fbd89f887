"""The torch ops' schemas and autograd plumbing, derived from cuflash/signature.py's lists (no torch needed)."""
from cuflash import signature


def test_schemas_are_the_registered_ones():
    # The exact text torch.compile caches and opcheck tests were written against.
    assert signature.FWD_SCHEMA == (
        "(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, str algorithm, "
        "bool deterministic, float dropout_p, int seed, str? backend=None) -> (Tensor, Tensor)")
    assert signature.BWD_SCHEMA == (
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float? softmax_scale, bool deterministic, float dropout_p, int seed) -> (Tensor, Tensor, Tensor)")


def test_parameter_lists():
    assert signature.FWD_ARGS == ("q", "k", "v", "causal", "softmax_scale", "algorithm", "deterministic",
                                  "dropout_p", "seed", "backend")
    assert signature.BWD_ARGS == ("dout", "q", "k", "v", "out", "lse", "causal", "softmax_scale", "deterministic",
                                  "dropout_p", "seed")


def test_autograd_hands_the_forward_options_to_the_backward():
    fwd_inputs = ("Q", "K", "V", True, 0.5, "v1", True, 0.1, -3, "sm90")
    assert signature.backward_options(fwd_inputs) == (True, 0.5, True, 0.1, -3)  # neither algorithm nor backend
    # dq, dk, dv and one None per forward option: autograd wants a gradient per forward input
    assert 3 + len(signature.OPTION_GRADS) == len(signature.FWD_ARGS)
    assert set(signature.OPTION_GRADS) == {None}
