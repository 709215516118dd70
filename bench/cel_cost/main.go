// Command cel_cost times the Kubernetes API server's own CRD validator (apiextensions-apiserver's CEL
// validator, the code kube-apiserver runs for x-kubernetes-validations) on one object, outside a server:
// the CPU time and the bytes and objects it allocates per validation. Allocations are deterministic, so
// two CRDs' rules compare exactly on a busy machine where a server's CPU figures drift by 10 %.
//
// Modes, as the API server validates them:
//   - create: the object alone (no old object);
//   - status: an update whose only change is in status (what every status write is: the status
//     subresource keeps the old spec), with ratcheting as the server does it.
//
// The object is given as JSON; the CRD's schema defaults are applied first, as the server stores it.
// bench/cel_validator_cost.py builds and drives it.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime"
	"time"

	apiextensionsinternal "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel/model"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	kjson "k8s.io/apimachinery/pkg/util/json"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/cel/common"
	"sigs.k8s.io/yaml"
)

type result struct {
	Mode            string  `json:"mode"`
	Iterations      int     `json:"iterations"`
	MicrosPerCall   float64 `json:"us_per_validation"`
	KiBPerCall      float64 `json:"kib_allocated_per_validation"`
	ObjectsPerCall  float64 `json:"objects_allocated_per_validation"`
	ValidationError string  `json:"validation_error,omitempty"`
}

func main() {
	crdPath := flag.String("crd", "", "the CRD (YAML); its first version's schema is used")
	objPath := flag.String("obj", "", "the object (JSON)")
	mode := flag.String("mode", "create", "create | status")
	n := flag.Int("n", 1000, "validations to time (after 50 warm-up ones)")
	flag.Parse()
	if *crdPath == "" || *objPath == "" || (*mode != "create" && *mode != "status") {
		fail("usage: cel_cost -crd CRD.yaml -obj OBJECT.json [-mode create|status] [-n N]")
	}

	raw, err := os.ReadFile(*crdPath)
	check(err, "reading the CRD")
	var crd apiextensionsv1.CustomResourceDefinition
	check(yaml.Unmarshal(raw, &crd), "parsing the CRD")
	if len(crd.Spec.Versions) == 0 || crd.Spec.Versions[0].Schema == nil {
		fail("the CRD has no version with a schema")
	}
	var internal apiextensionsinternal.JSONSchemaProps
	check(apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(
		crd.Spec.Versions[0].Schema.OpenAPIV3Schema, &internal, nil), "converting the schema")
	structural, err := schema.NewStructural(&internal)
	check(err, "the schema is not structural")

	objRaw, err := os.ReadFile(*objPath)
	check(err, "reading the object")
	load := func() map[string]interface{} {
		var o map[string]interface{}
		check(kjson.Unmarshal(objRaw, &o), "parsing the object") // int64 numbers, as the server decodes them
		structuraldefaulting.Default(o, structural)
		return o
	}
	obj := load()
	var old map[string]interface{}
	if *mode == "status" {
		old = load()
		status, _ := obj["status"].(map[string]interface{})
		if status == nil {
			status = map[string]interface{}{}
			obj["status"] = status
		}
		status["observedGeneration"] = int64(12345) // a changed status; the spec is the old one
	}

	validator := cel.NewValidator(structural, true, celconfig.PerCallLimit)
	ctx := context.Background()
	validate := func() string {
		var opts []cel.Option
		var oldArg interface{}
		if old != nil {
			oldArg = old
			opts = append(opts, cel.WithRatcheting(common.NewCorrelatedObject(obj, old, &model.Structural{Structural: structural})))
		}
		errs, _ := validator.Validate(ctx, nil, structural, obj, oldArg, celconfig.RuntimeCELCostBudget, opts...)
		if len(errs) > 0 {
			return errs.ToAggregate().Error()
		}
		return ""
	}

	res := result{Mode: *mode, Iterations: *n}
	if msg := validate(); msg != "" {
		res.ValidationError = msg // an object the rules refuse: timed anyway, and said
	}
	for i := 0; i < 50; i++ {
		validate()
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	for i := 0; i < *n; i++ {
		validate()
	}
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	res.MicrosPerCall = float64(elapsed.Nanoseconds()) / 1e3 / float64(*n)
	res.KiBPerCall = float64(after.TotalAlloc-before.TotalAlloc) / 1024 / float64(*n)
	res.ObjectsPerCall = float64(after.Mallocs-before.Mallocs) / float64(*n)
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

func check(err error, what string) {
	if err != nil {
		fail(what + ": " + err.Error())
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "cel_cost: "+msg)
	os.Exit(2)
}
