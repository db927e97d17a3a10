# Copied verbatim from THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
# (https://github.com/THUDM/slime), file(s): slime/utils/arguments.py.
# slime is licensed under the Apache License, Version 2.0 (the "License"); you may not use this
# file except in compliance with the License. You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software distributed under the
# License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND,
# either express or implied. See the License for the specific language governing permissions
# and limitations under the License.
#
# slime is not on a package index, and its modules import SGLang, Megatron-LM and Ray at load
# time, so the tests run these definitions from its source. Only the imports are rewritten (to
# the other copies here); each definition keeps upstream's text (line numbers given).
# The two `parser.add_argument` calls of slime's rollout arguments that name the log plugins,
# in a function of their own (upstream they sit in `get_slime_extra_args_provider`).


def add_log_function_arguments(parser):
    # slime/utils/arguments.py, lines 495-514
    parser.add_argument(
        "--custom-rollout-log-function-path",
        type=str,
        default=None,
        help=(
            "The custom function for logging rollout data. The signature of the functions is: "
            "def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool. "
            "The return value indicates whether to skip the default logging. "
        ),
    )
    parser.add_argument(
        "--custom-eval-rollout-log-function-path",
        type=str,
        default=None,
        help=(
            "The custom function for logging eval rollout data. "
            "def log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool. "
            "The return value indicates whether to skip the default logging. "
        ),
    )
    return parser
