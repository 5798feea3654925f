"""Request and response shapes shared by the HTTP API and the MCP tools."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SearchRequest(BaseModel):
    """Body of `POST /search` and `POST /answer`. Types are strict: "3" is not a number of turns."""

    model_config = ConfigDict(extra="forbid")

    question: str = Field(strict=True, description="The question to gather evidence for.")
    max_turns: int | None = Field(None, strict=True, description="Search rounds (default: the loop's own).")
    top_k: int | None = Field(
        None, strict=True, description="Documents per search (default: the loop's own)."
    )


class ContextDoc(BaseModel):
    id: str
    title: str
    text: str


class SearchCall(BaseModel):
    """The documents one search call returned."""

    query: str
    documents: list[ContextDoc]


class TrajectoryView(BaseModel):
    queries: list[str]
    documents: list[list[ContextDoc]] = Field(description="Documents per search call, in order.")
    answer: str | None = Field(None, description="The searcher's own answer, if its loop gives one.")
    evidence: str | None = Field(None, description="R-Search: the <original_evidence> block.")
    finish_reason: str
    num_turns: int


class Timings(BaseModel):
    queue_s: float = Field(description="Waiting for a batch slot.")
    search_s: float = Field(description="The batched rollout this request was part of.")
    answer_s: float = 0.0
    total_s: float


class SearchResponse(BaseModel):
    question: str
    loop: str
    context: list[ContextDoc] = Field(description="The served context: what a downstream LLM should read.")
    context_text: str = Field(description="The served context formatted for an LLM prompt.")
    trajectory: TrajectoryView
    retrieval_count: int
    batch_size: int = Field(description="Requests that shared this request's rollout.")
    timings: Timings


class AnswerResponse(SearchResponse):
    answer: str = Field(description="The frozen generator's answer from the served context.")
