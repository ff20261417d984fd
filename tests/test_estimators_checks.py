"""aeon's estimator checks (aeon.testing) and scikit-learn's, on SeqClassifier and SeqRegressor with
their small test parameters (_get_test_params: hidden 4, 3 epochs, on the CPU).

aeon's checks all run. scikit-learn's checks assume tabular estimators; the ones that contradict
aeon's own collection conventions (which every aeon estimator follows) are skipped with the reason
below, the rest run."""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("aeon", reason="the estimators need aeon (pip install 'vlseq_ext[ts]')")

from aeon.testing.estimator_checking import parametrize_with_checks  # noqa: E402
from sklearn.utils.estimator_checks import estimator_checks_generator  # noqa: E402

from vlseq_ext.estimators import SeqClassifier, SeqRegressor  # noqa: E402



AEON_INPUT = "aeon takes numpy arrays, pandas frames and lists of 2D arrays, not other array-likes"
AEON_Y = "aeon refuses a y that is not 1-D (TypeError) before the estimator sees it"
NOT_APPLICABLE = {
    "check_classifier_data_not_an_array": AEON_INPUT,
    "check_regressor_data_not_an_array": AEON_INPUT,
    "check_classifiers_train": "passes X as a list of row lists; aeon refuses lists of lists",
    "check_regressors_train": "passes X as a list of row lists; aeon refuses lists of lists",
    "check_classifiers_one_label": "aeon refuses a single class by design ('y must contain at least 2 unique labels')",
    "check_fit2d_1sample": "expects sklearn's wording; aeon's is 'y must contain at least 2 unique labels' "
                           "(classifier) or that y is binary (regressor)",
    "check_supervised_y_2d": AEON_Y,
    "check_requires_y_none": AEON_Y,
    "check_n_features_in": "aeon estimators describe X in metadata_ (channels, lengths), not n_features_in_",
    "check_n_features_in_after_fitting": "aeon estimators describe X in metadata_, not n_features_in_",
    "check_fit1d": "aeon raises TypeError, not ValueError, for 1-D X",
    "check_fit2d_predict1d": "aeon raises TypeError, not ValueError, for 1-D X",
    "check_no_attributes_set_in_init": "aeon's base class sets is_fitted and metadata_ in __init__",
    "check_dont_overwrite_parameters": "aeon's base class sets the public is_fitted in fit",
    "check_complex_data": "aeon refuses complex X with its own TypeError ('numeric values only')",
    "check_dtype_object": "aeon refuses object arrays with its own TypeError ('numeric values only')",
    "check_estimators_empty_data_messages": "expects sklearn's wording; ours is 'X: the series are empty "
                                            "(shape (12, 0))' (tested in test_estimators.py)",
}
# scikit-learn gives these regression checks a two-valued y, which aeon's check_regression_y refuses
# ("y type is binary which is not valid for regression")
BINARY_Y = "sklearn passes a two-valued y; aeon refuses it for regression as 'binary'"
REGRESSOR_NOT_APPLICABLE = {name: BINARY_Y for name in (
    "check_estimators_dtypes", "check_pipeline_consistency", "check_estimators_pickle", "check_estimators_nan_inf",
    "check_fit2d_1feature")}


@parametrize_with_checks([SeqClassifier, SeqRegressor])
def test_aeon_estimator_checks(check):
    result = check()
    if isinstance(result, str):  # aeon's way to say a check does not apply (no stored results for us)
        pytest.skip(result)


def _sklearn_checks():
    params = dict(SeqClassifier._get_test_params(), n_networks=1, random_state=0)  # aeon's checks cover 2
    for est, skips in ((SeqClassifier(**params), NOT_APPLICABLE),
                       (SeqRegressor(**params), {**NOT_APPLICABLE, **REGRESSOR_NOT_APPLICABLE})):
        for e, check in estimator_checks_generator(est, expected_failed_checks=skips, mark="skip"):
            name = check.func.__name__ if isinstance(check, functools.partial) else check.__name__
            yield pytest.param(e, check, id=f"{type(e).__name__}-{name}")


@pytest.mark.filterwarnings("ignore::UserWarning")  # aeon warns of constant series in sklearn's tiny data
@pytest.mark.parametrize("estimator,check", list(_sklearn_checks()))
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)
