"""The gRPC edge: Open Inference Protocol, residency.v1 admin, health, reflection (only this
package imports the generated `residency_proto` code; it converts to domain objects at the edge)."""
