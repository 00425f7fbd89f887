"""The torch ops' schemas and autograd plumbing, derived from cuflash/signature.py's lists (no torch needed)."""
from cuflash import signature


def test_schemas_are_the_registered_ones():
    # The exact text torch.compile caches and opcheck tests were written against.
    assert signature.FWD_SCHEMA == (
        "(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, str algorithm, "
        "bool deterministic, float dropout_p, int seed, str? backend=None, int[] window_size=[-1, -1], "
        'str alignment="bottom_right", float softcap=0.0) -> (Tensor, Tensor)')
    assert signature.BWD_SCHEMA == (
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float? softmax_scale, bool deterministic, float dropout_p, int seed, int[] window_size=[-1, -1], "
        'str alignment="bottom_right", float softcap=0.0) -> (Tensor, Tensor, Tensor)')


def test_parameter_lists():
    assert signature.FWD_ARGS == ("q", "k", "v", "causal", "softmax_scale", "algorithm", "deterministic",
                                  "dropout_p", "seed", "backend", "window_size", "alignment", "softcap")
    assert signature.BWD_ARGS == ("dout", "q", "k", "v", "out", "lse", "causal", "softmax_scale", "deterministic",
                                  "dropout_p", "seed", "window_size", "alignment", "softcap")


def test_autograd_hands_the_forward_options_to_the_backward():
    fwd_inputs = ("Q", "K", "V", True, 0.5, "v1", True, 0.1, -3, "sm90", (4, 0), "top_left", 30.0)
    assert signature.backward_options(fwd_inputs) == (True, 0.5, True, 0.1, -3, (4, 0), "top_left", 30.0)  # not algorithm, backend
    # dq, dk, dv and one None per forward option: autograd wants a gradient per forward input
    assert 3 + len(signature.OPTION_GRADS) == len(signature.FWD_ARGS)
    assert set(signature.OPTION_GRADS) == {None}


def test_mask_options_are_the_record_fields():
    from cuflash.mask import MaskOptions

    assert signature.MASK_OPTIONS == MaskOptions.schema_options()
    assert signature.MASK_NAMES == ("causal", "window_size", "alignment", "softcap")
    for opts in (signature.FWD_OPTIONS, signature.BWD_OPTIONS):
        assert all(o in opts for o in signature.MASK_OPTIONS)


def test_a_new_mask_field_joins_both_schemas(monkeypatch):
    """A field added to MaskOptions (with a schema default, as any field added after the first
    release) becomes an argument of both ops, after the older options: no edit here."""
    import importlib.util

    from cuflash import mask

    extra = (("align_top_left", "bool", "False"),)
    original = mask.MaskOptions.schema_options.__func__
    monkeypatch.setattr(mask.MaskOptions, "schema_options", classmethod(lambda cls: original(cls) + extra))
    spec = importlib.util.spec_from_file_location("cuflash._signature_probe", signature.__file__)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.FWD_SCHEMA == signature.FWD_SCHEMA.replace(
        'float softcap=0.0)', 'float softcap=0.0, bool align_top_left=False)')
    assert probe.BWD_SCHEMA == signature.BWD_SCHEMA.replace(
        'float softcap=0.0)', 'float softcap=0.0, bool align_top_left=False)')
    assert probe.FWD_ARGS[-1] == probe.BWD_ARGS[-1] == "align_top_left"
    assert len(probe.OPTION_GRADS) == len(signature.OPTION_GRADS) + 1
    fwd_inputs = ("Q", "K", "V", True, 0.5, "v1", True, 0.1, -3, "sm90", (4, 0), "top_left", 30.0, True)
    assert probe.backward_options(fwd_inputs) == (True, 0.5, True, 0.1, -3, (4, 0), "top_left", 30.0, True)
