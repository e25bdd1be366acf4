"""OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``): HTTP only.

What a file or a batch is, how its lines are checked and run, is omni_jobs.accept.files, omni_jobs.accept.batch_lines
and omni_jobs.accept.batches; this module parses, calls them (in a thread where they do I/O or CPU work) and
answers in OpenAI's shapes, errors included (``{"error": {message, type, param, code}}``). Every route
is the caller's tenant's: another tenant's file or batch is a 404, as a missing one.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from api.auth import api_key_id, authenticate
from api.deps import get_context
from api.routes.openai import OpenAIErrorBody
from api.schemas import errors
from omni_jobs.accept.batch_lines import ENDPOINTS, BatchFileInvalid
from omni_jobs.accept.batches import WINDOWS, Batches
from omni_jobs.accept.files import JSONL, FileNotFound, FileRecord
from omni_jobs.accept.openai_errors import OpenAIError
from omni_jobs.core.json_types import JsonObject

router = APIRouter(prefix="/v1", tags=["batches"], responses=errors(401, 503))
_TEXT = {400: "A field is invalid; `param` names it (a refused file also lists its faulty lines in `errors`).",
         404: "No such file or batch for this tenant (for a list: no batch `after` names).",
         409: "The batch ended: it cannot be cancelled.",
         413: "The file is larger than OMNI_BATCH_FILE_MAX_BYTES."}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": OpenAIErrorBody, "description": _TEXT[code]} for code in codes}


_FILE_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary",
                            "description": "JSONL: one {custom_id, method: POST, url, body} a line."},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}
_BATCH_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {"input_file_id": {"type": "string", "description": "A file of this tenant, purpose batch."},
                   "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
                   "completion_window": {"type": "string", "enum": list(WINDOWS)},
                   "metadata": {"anyOf": [{"type": "object", "maxProperties": 16,
                                           "additionalProperties": {"type": "string", "maxLength": 512}},
                                          {"type": "null"}]},
                   "webhook": {"anyOf": [{"type": "string"}, {"type": "null"}],
                               "description": "Where batch.completed / failed / expired / cancelled is POSTed, "
                                              "signed as job webhooks are."}}}}}}}


def install(app: FastAPI) -> None:
    """Add the routes (the OpenAI error handler is openai.install's)."""
    app.include_router(router, dependencies=[Depends(authenticate)])


def _batches(request: Request) -> Batches:
    return get_context(request).runtime.batches


def _file(batches: Batches, tenant: str, file_id: str) -> FileRecord:
    try:
        return batches.files.get(tenant, file_id)
    except FileNotFound:
        raise OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found") from None


# --- files ---
@router.post("/files", summary="Upload a batch input file (multipart: file, purpose=batch); checked line by line",
             openapi_extra=_FILE_FORM, responses=_errors(400, 413))
async def create_file(request: Request) -> JSONResponse:
    batches = _batches(request)
    settings = get_context(request).runtime.settings
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise OpenAIError(400, "send multipart/form-data: the JSONL as the part 'file', and purpose=batch",
                          param="file")
    form = await request.form()
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise OpenAIError(400, f"purpose must be 'batch' (the only purpose this server takes); got {purpose!r}",
                          param="purpose")
    if not isinstance(upload, UploadFile):
        raise OpenAIError(400, "file is required: the JSONL, as a file part", param="file")
    limit = settings.batch_file_max_bytes
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise OpenAIError(413, f"file is larger than {limit} bytes (OMNI_BATCH_FILE_MAX_BYTES): split it",
                          param="file", code="file_too_large")
    try:
        summary = await run_in_threadpool(batches.check_file, data)
    except BatchFileInvalid as exc:
        body: JsonObject = {"error": {"message": f"the file is refused: {exc}", "type": "invalid_request_error",
                                      "param": "file", "code": "invalid_batch_file"},
                            "errors": {"object": "list", "total": exc.total,
                                       "data": [e.as_json() for e in exc.errors]}}
        return JSONResponse(body, status_code=400)
    record = await run_in_threadpool(batches.files.put, request.state.tenant, data,
                                     filename=upload.filename or "batch.jsonl", purpose="batch", lines=summary.lines)
    return JSONResponse(record.as_openai())


@router.get("/files", summary="The tenant's files, newest first")
async def list_files(request: Request, limit: Annotated[int, Query(ge=1, le=10000)] = 100) -> dict[str, Any]:
    records = await run_in_threadpool(_batches(request).files.list, request.state.tenant, limit=limit)
    return {"object": "list", "data": [r.as_openai() for r in records], "has_more": False}


@router.get("/files/{file_id}", summary="One file's record", responses=_errors(404))
async def get_file(file_id: str, request: Request) -> dict[str, object]:
    record = await run_in_threadpool(_file, _batches(request), request.state.tenant, file_id)
    return record.as_openai()


@router.get("/files/{file_id}/content", summary="A file's bytes (JSONL)", response_class=Response,
            responses={200: {"content": {JSONL: {"schema": {"type": "string"}}}}, **_errors(404)})
async def file_content(file_id: str, request: Request) -> Response:
    batches = _batches(request)
    record = await run_in_threadpool(_file, batches, request.state.tenant, file_id)
    data: bytes = await run_in_threadpool(batches.files.artifacts.get, record.artifact)
    return Response(data, media_type=JSONL)


@router.delete("/files/{file_id}", summary="Delete a file (its record and its bytes)", responses=_errors(404))
async def delete_file(file_id: str, request: Request) -> dict[str, object]:
    batches = _batches(request)
    try:
        await run_in_threadpool(batches.files.delete, request.state.tenant, file_id)
    except FileNotFound:
        raise OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found") from None
    return {"id": file_id, "object": "file", "deleted": True}


# --- batches ---
@router.post("/batches", summary="Run a batch file's requests as low-priority jobs", openapi_extra=_BATCH_BODY,
             responses=_errors(400, 404))
async def create_batch(request: Request) -> JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        raise OpenAIError(400, "the body is not JSON: send {input_file_id, endpoint, completion_window}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body is a JSON object: {input_file_id, endpoint, completion_window}")
    batches = _batches(request)
    batch = await run_in_threadpool(
        lambda: batches.create(request.state.tenant, input_file_id=body.get("input_file_id"),
                               endpoint=body.get("endpoint"), completion_window=body.get("completion_window"),
                               metadata=body.get("metadata"), webhook=body.get("webhook"),
                               api_key_id=api_key_id(request)))
    return JSONResponse(batch)


@router.get("/batches", summary="The tenant's batches, newest first (after: the last id of the previous page)",
            responses=_errors(404))
async def list_batches(request: Request, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> JsonObject:
    page: JsonObject = await run_in_threadpool(_batches(request).page, request.state.tenant, after=after, limit=limit)
    return page


@router.get("/batches/{batch_id}", summary="One batch: status, request_counts, output and error files",
            responses=_errors(404))
async def get_batch(batch_id: str, request: Request) -> JsonObject:
    batch: JsonObject = await run_in_threadpool(_batches(request).get, request.state.tenant, batch_id)
    return batch


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch: its running jobs are canceled, then it ends",
             responses=_errors(404, 409))
async def cancel_batch(batch_id: str, request: Request) -> JsonObject:
    batch: JsonObject = await run_in_threadpool(_batches(request).cancel, request.state.tenant, batch_id)
    return batch
