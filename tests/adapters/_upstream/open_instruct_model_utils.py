# Copied verbatim from allenai/open-instruct at commit e6c3044aa6201c8bfa4573c1b03142af599e730d
# (https://github.com/allenai/open-instruct), file(s): open_instruct/model_utils.py.
# open-instruct is licensed under the Apache License, Version 2.0 (the "License"); you may not
# use this file except in compliance with the License. You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software distributed under the
# License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND,
# either express or implied. See the License for the specific language governing permissions
# and limitations under the License.
#
# open-instruct cannot be installed from a package index, so the tests run these definitions
# from its source. Only the definitions the tests run are copied; each keeps upstream's text
# (line numbers given). 

from dataclasses import dataclass, field


# open_instruct/model_utils.py lines 118-174
@dataclass
class Batch:
    """Container for batch data including queries, ground truths, and datasets."""

    queries: list[list[int]]
    ground_truths: list[list[int]]
    datasets: list[str]
    raw_queries: list[str] | None
    decoded_responses: list[str] | None
    indices: list[int] | None
    scores: list[float] | None
    active_tools: list[list[str] | None] | None = None
    model_steps: list[int] = field(default_factory=list)

    def __getitem__(self, key: slice | int | list[int]) -> "Batch":
        """Enable indexing and slicing: batch[5], batch[start:end], or batch[[1,3,5]]."""
        if isinstance(key, slice):
            # Handle slice object: batch[start:end]
            return Batch(
                queries=self.queries[key],
                ground_truths=self.ground_truths[key],
                datasets=self.datasets[key],
                raw_queries=self.raw_queries[key] if self.raw_queries is not None else None,
                decoded_responses=self.decoded_responses[key] if self.decoded_responses is not None else None,
                indices=self.indices[key] if self.indices is not None else None,
                scores=self.scores[key] if self.scores is not None else None,
                active_tools=self.active_tools[key] if self.active_tools is not None else None,
                model_steps=self.model_steps[key],
            )
        elif isinstance(key, int):
            # Handle single index: batch[5]
            return Batch(
                queries=[self.queries[key]],
                ground_truths=[self.ground_truths[key]],
                datasets=[self.datasets[key]],
                raw_queries=[self.raw_queries[key]] if self.raw_queries is not None else None,
                decoded_responses=[self.decoded_responses[key]] if self.decoded_responses is not None else None,
                indices=[self.indices[key]] if self.indices is not None else None,
                scores=[self.scores[key]] if self.scores is not None else None,
                active_tools=[self.active_tools[key]] if self.active_tools is not None else None,
                model_steps=[self.model_steps[key]],
            )
        else:
            # Handle list of indices: batch[[1,3,5]]
            return Batch(
                queries=[self.queries[i] for i in key],
                ground_truths=[self.ground_truths[i] for i in key],
                datasets=[self.datasets[i] for i in key],
                raw_queries=[self.raw_queries[i] for i in key] if self.raw_queries is not None else None,
                decoded_responses=[self.decoded_responses[i] for i in key]
                if self.decoded_responses is not None
                else None,
                indices=[self.indices[i] for i in key] if self.indices is not None else None,
                scores=[self.scores[i] for i in key] if self.scores is not None else None,
                active_tools=[self.active_tools[i] for i in key] if self.active_tools is not None else None,
                model_steps=[self.model_steps[i] for i in key],
            )
